#include "tessera/core/error.h"

#include <fmt/format.h>

namespace tessera {

void throw_internal_error(const char* file, int line, const std::string& message) {
  throw InternalError(fmt::format("internal error at {}:{}: {}", file, line, message));
}

}  // namespace tessera

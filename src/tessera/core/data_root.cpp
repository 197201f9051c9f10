#include "tessera/core/data_root.h"

#include <cstdlib>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace tessera {

namespace fs = std::filesystem;

namespace {

const char* env_value(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

}  // namespace

std::string DataRoot::tokenizer_dir(const std::string& name, const std::string& npm_package) const {
  const fs::path root(dir);
  return (is_checkout() ? root / "node_modules" / npm_package / "models"
                        : root / "tokenizers" / name)
      .string();
}

std::string DataRoot::dataset_dir() const {
  const fs::path root(dir);
  return (is_checkout() ? root / "build" / "data" : root / "data").string();
}

std::string DataRoot::explain() const {
  std::string provides;
  switch (kind) {
    case DataRootKind::TesseraHome:
      provides =
          "TESSERA_HOME names an install's data directory, PREFIX/share/tessera (README.md, "
          "Install); unset it to use the install beside the binary or the source checkout";
      break;
    case DataRootKind::InstallBesideBinary:
      provides =
          "this install is incomplete: install again with `cmake --install BUILD --prefix "
          "PREFIX`, or set TESSERA_HOME to a complete install's share/tessera";
      break;
    case DataRootKind::Checkout:
      provides =
          "in a source checkout scripts/setup.sh installs the npm packages and prepares the "
          "datasets; set TESSERA_ROOT to a checkout that has them, or TESSERA_HOME to an "
          "install's share/tessera";
      break;
  }
  return fmt::format("Tessera's data root is {} ({}; searched in order: {}); {}", dir, origin,
                     fmt::join(searched, ", "), provides);
}

DataRoot data_root() {
  DataRoot r;
  if (const char* home = env_value("TESSERA_HOME")) {
    r.dir = home;
    r.kind = DataRootKind::TesseraHome;
    r.origin = "$TESSERA_HOME";
    r.searched.push_back(fmt::format("$TESSERA_HOME={}", home));
    return r;
  }
  r.searched.push_back("$TESSERA_HOME (not set)");

  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path beside = exe.parent_path().parent_path() / "share" / "tessera";
    if (fs::is_directory(beside, ec)) {
      r.dir = beside.string();
      r.kind = DataRootKind::InstallBesideBinary;
      r.origin = "the install of " + exe.string();
      r.searched.push_back(r.dir);
      return r;
    }
    r.searched.push_back(fmt::format("{} (no install beside {})", beside.string(), exe.string()));
  }

  r.kind = DataRootKind::Checkout;
  if (const char* root = env_value("TESSERA_ROOT")) {
    r.dir = root;
    r.origin = "the source checkout $TESSERA_ROOT";
    r.searched.push_back(fmt::format("$TESSERA_ROOT={}", root));
  } else {
    r.dir = TESSERA_SOURCE_DIR;
    r.origin = "the source checkout this binary was built from";
    r.searched.push_back(r.dir + " ($TESSERA_ROOT not set)");
  }
  return r;
}

}  // namespace tessera

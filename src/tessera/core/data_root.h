#pragma once
// Where Tessera finds the files it reads at run time besides the user's own: the tokenizer files
// of the shipped tokenizer names and the prepared datasets of the shipped experiments. The search
// order is defined here, once, and every reader asks data_root():
//   1. $TESSERA_HOME, when set: an install's data directory (PREFIX/share/tessera, or a copy of
//      it). Nothing else is searched, so a wrong value fails instead of quietly reading other
//      files.
//   2. share/tessera beside the running binary's folder, when it exists: the tree that
//      `cmake --install BUILD --prefix PREFIX` writes (PREFIX/bin/tessera,
//      PREFIX/share/tessera), wherever it has been moved or copied to.
//   3. A source checkout: $TESSERA_ROOT when set (a build carried to another machine with its
//      node_modules, scripts/device/), else the tree this binary was built from. There
//      scripts/setup.sh installs the npm packages and prepares the datasets in build/data.
// The first that applies is the data root. A file missing there is an error that names the path
// and this search, never a look into the next root: an installed binary must not depend on the
// checkout it was built from.
#include <string>
#include <vector>

namespace tessera {

// Which step of the search found the root. The first two are laid out as an install,
// PREFIX/share/tessera (tokenizers/NAME/, data/); a checkout as the source tree
// (node_modules/NPM_PACKAGE/models/, build/data/).
enum class DataRootKind { TesseraHome, InstallBesideBinary, Checkout };

struct DataRoot {
  std::string dir;
  DataRootKind kind = DataRootKind::Checkout;
  std::string origin;                 // for messages: "$TESSERA_HOME", "the install of ..."
  std::vector<std::string> searched;  // each step of the search up to this root, for messages

  bool is_checkout() const { return kind == DataRootKind::Checkout; }

  // The directory of a shipped tokenizer's tokenizer.json and tokenizer_config.json:
  // ROOT/tokenizers/NAME (install) or ROOT/node_modules/NPM_PACKAGE/models (checkout).
  std::string tokenizer_dir(const std::string& name, const std::string& npm_package) const;
  // The directory of the shipped experiments' prepared datasets: ROOT/data (install) or
  // ROOT/build/data (checkout, where scripts/data/prepare_brown.sh writes them).
  std::string dataset_dir() const;
  // For a message about a file not found under this root: which root was searched and why,
  // every step of the search, and what provides the files ("Tessera's data root is ...").
  std::string explain() const;
};

// The data root by the search order above, found anew on each call (the environment decides).
DataRoot data_root();

}  // namespace tessera

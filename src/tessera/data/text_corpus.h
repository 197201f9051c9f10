#pragma once
// Plain-text corpora: a directory (one document per file, sorted by name) or one file
// (documents separated by blank lines). Files of the tagged Brown corpus ("The/at jury/nn")
// are recognised and turned back into running text.
#include <string>
#include <string_view>
#include <vector>

namespace tessera {

std::vector<std::string> load_text_documents(const std::string& path);

// The document files of a directory, sorted by name: the Brown corpus's cXNN files when there
// are any, else its *.txt and *.text files. Throws DataError when there are none.
std::vector<std::string> list_text_files(const std::string& dir);

// One file as one document's text: '\r' dropped, Brown tags turned back into running text.
std::string read_text_document(const std::string& file);

// "The/at jury/nn said/vbd ``/`` no/at ./." -> "The jury said \"no.": drops the tags and
// re-attaches punctuation; each input line (a sentence) becomes one line.
std::string brown_to_text(std::string_view tagged);

// True when the text looks like Brown-corpus tagged tokens.
bool looks_like_brown(std::string_view text);

}  // namespace tessera

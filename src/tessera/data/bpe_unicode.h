#pragma once
// UTF-8 decoding and Unicode NFC normalisation for the Hugging Face tokenizer (Qwen's
// tokenizer.json normalises to NFC). Text may hold invalid UTF-8: a byte that does not start
// a valid sequence passes through unchanged and nothing composes across it, so no input byte
// is ever lost. Unicode data: 14.0, the version of the PCRE2 tables the pre-tokenizer uses.
#include <string>
#include <string_view>

namespace tessera::unicode {

// The length (1-4) of the valid UTF-8 sequence at p, storing its code point in *cp, or 0 when
// the bytes at p do not start one (stray continuation byte, truncated, overlong, surrogate,
// above U+10FFFF).
int decode_utf8(const char* p, const char* end, char32_t* cp);

void append_utf8(char32_t cp, std::string* out);

// True when text is certainly in NFC: every code point below U+0300 is, and UTF-8 encodes
// U+0300 and above with lead bytes from 0xCC up.
bool is_trivially_nfc(std::string_view text);

// Appends the NFC form of text to out.
void append_nfc(std::string_view text, std::string* out);

}  // namespace tessera::unicode

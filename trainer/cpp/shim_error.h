// The one error convention of titan-train's C++ shims, in both directions: a call returns 0, or
// non-zero with a malloc'd NUL-terminated message in `*err` that the receiver frees with free().
// C++ entry points fill it from any exception (nothing unwinds into Rust); the Rust callbacks
// the shims call (autograd functions, recompute regions) fill it from a panic, and the shim turns
// it back into an exception (trainer/src/shim.rs is the Rust side).
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

namespace titan_shim {

// A malloc'd copy of `s` for `*err` (null when out of memory: the receiver then reports the code).
inline char* copy_message(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.data(), s.size());
    out[s.size()] = '\0';
  }
  return out;
}

// The message a callee left in `err` (freed here); `fallback` when it left none.
inline std::string take_message(char* err, const char* fallback) {
  if (err == nullptr) return fallback;
  std::string s(err);
  std::free(err);
  return s;
}

// Runs `body`; returns 0, or 1 with the exception's message in `*err`.
template <typename F>
int guarded(char** err, F&& body) {
  try {
    std::forward<F>(body)();
    return 0;
  } catch (const c10::Error& e) {
    *err = copy_message(e.what_without_backtrace());
  } catch (const std::exception& e) {
    *err = copy_message(e.what());
  } catch (...) {
    *err = copy_message("unknown C++ exception");
  }
  return 1;
}

}  // namespace titan_shim

// A C ABI over libtorch's c10d::TCPStore, the key-value store torchrun's agent, torch.distributed
// and titan-train's ranks rendezvous through. Every entry point catches every C++ exception and
// returns an error code plus a malloc'd message in `*err` (shim_error.h's convention, with codes
// for timeouts and network errors); nothing unwinds into Rust.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "shim_error.h"

namespace {

// Error codes shared with trainer/src/dist/store.rs.
constexpr int kOk = 0;
constexpr int kError = 1;
constexpr int kTimeout = 2;
constexpr int kNetwork = 3;

struct Store {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

using titan_shim::copy_message;

bool mentions_timeout(const std::string& msg) {
  return msg.find("imeout") != std::string::npos || msg.find("timed out") != std::string::npos;
}

// Runs `body`, translating any exception into a code and a message in *err.
template <typename F>
int guarded(char** err, F&& body) {
  try {
    body();
    return kOk;
  } catch (const c10d::TimeoutError& e) {
    *err = copy_message(e.what_without_backtrace());
    return kTimeout;
  } catch (const c10::DistNetworkError& e) {
    std::string msg = e.what_without_backtrace();
    *err = copy_message(msg);
    return mentions_timeout(msg) ? kTimeout : kNetwork;
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    *err = copy_message(msg);
    return mentions_timeout(msg) ? kTimeout : kError;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    *err = copy_message(msg);
    return mentions_timeout(msg) ? kTimeout : kError;
  } catch (...) {
    *err = copy_message("unknown C++ exception in TCPStore");
    return kError;
  }
}

std::vector<std::string> to_keys(const char* const* keys, size_t n) {
  std::vector<std::string> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.emplace_back(keys[i]);
  return out;
}

}  // namespace

extern "C" {

// Connects to (or, with is_server, hosts) the store at host:port. port 0 with is_server picks a
// free port (see titan_store_port). num_workers < 0 means unknown; wait_workers makes the server
// wait for num_workers clients during construction.
int titan_store_new(const char* host, uint16_t port, int is_server, int64_t num_workers,
                    int wait_workers, int64_t timeout_ms, int use_libuv, Store** out, char** err) {
  *out = nullptr;
  return guarded(err, [&] {
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_server != 0;
    if (num_workers >= 0) opts.numWorkers = static_cast<size_t>(num_workers);
    opts.waitWorkers = wait_workers != 0;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    opts.useLibUV = use_libuv != 0;
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    *out = new Store{std::move(store)};
  });
}

void titan_store_free(Store* s) {
  try {
    delete s;
  } catch (...) {
  }
}

void titan_store_free_buf(void* p) { std::free(p); }

uint16_t titan_store_port(const Store* s) { return s->store->getPort(); }

int titan_store_set_timeout(Store* s, int64_t timeout_ms, char** err) {
  return guarded(err, [&] { s->store->setTimeout(std::chrono::milliseconds(timeout_ms)); });
}

int titan_store_set(Store* s, const char* key, const uint8_t* value, size_t len, char** err) {
  return guarded(err, [&] {
    std::vector<uint8_t> v(value, value + len);
    s->store->set(std::string(key), v);
  });
}

// Blocks until the key exists (up to the store's timeout); the value is malloc'd into *value.
int titan_store_get(Store* s, const char* key, uint8_t** value, size_t* len, char** err) {
  *value = nullptr;
  *len = 0;
  return guarded(err, [&] {
    std::vector<uint8_t> v = s->store->get(std::string(key));
    *len = v.size();
    *value = static_cast<uint8_t*>(std::malloc(v.size() == 0 ? 1 : v.size()));
    if (*value == nullptr) throw std::bad_alloc();
    if (!v.empty()) std::memcpy(*value, v.data(), v.size());
  });
}

// Sets key to desired if its current value equals expected (an absent key matches an empty
// expected value); the resulting value is returned in *value.
int titan_store_compare_set(Store* s, const char* key, const uint8_t* expected, size_t expected_len,
                            const uint8_t* desired, size_t desired_len, uint8_t** value,
                            size_t* len, char** err) {
  *value = nullptr;
  *len = 0;
  return guarded(err, [&] {
    std::vector<uint8_t> e(expected, expected + expected_len);
    std::vector<uint8_t> d(desired, desired + desired_len);
    std::vector<uint8_t> v = s->store->compareSet(std::string(key), e, d);
    *len = v.size();
    *value = static_cast<uint8_t*>(std::malloc(v.size() == 0 ? 1 : v.size()));
    if (*value == nullptr) throw std::bad_alloc();
    if (!v.empty()) std::memcpy(*value, v.data(), v.size());
  });
}

int titan_store_add(Store* s, const char* key, int64_t delta, int64_t* result, char** err) {
  return guarded(err, [&] { *result = s->store->add(std::string(key), delta); });
}

int titan_store_delete(Store* s, const char* key, int* deleted, char** err) {
  return guarded(err, [&] { *deleted = s->store->deleteKey(std::string(key)) ? 1 : 0; });
}

int titan_store_check(Store* s, const char* const* keys, size_t n, int* present, char** err) {
  return guarded(err, [&] { *present = s->store->check(to_keys(keys, n)) ? 1 : 0; });
}

int titan_store_wait(Store* s, const char* const* keys, size_t n, int64_t timeout_ms, char** err) {
  return guarded(err, [&] {
    s->store->wait(to_keys(keys, n), std::chrono::milliseconds(timeout_ms));
  });
}

int titan_store_num_keys(Store* s, int64_t* n, char** err) {
  return guarded(err, [&] { *n = s->store->getNumKeys(); });
}

}  // extern "C"

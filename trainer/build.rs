//! Embeds libtorch's directory as an rpath so `titan-train` runs without LD_LIBRARY_PATH, and
//! keeps libtorch_cuda linked (the linker would drop it as unused with --as-needed, and then
//! CUDA would silently be unavailable on GPU machines).
//!
//! Also compiles `cpp/tcpstore_shim.cpp`: libtorch's c10d TCPStore (the rendezvous store torchrun
//! and torch.distributed speak) behind a C ABI, against the headers of the same libtorch; and the
//! small `rng_shim.cpp` (CPU generator state), `grad_shim.cpp` (set a grad to None),
//! `autocast_shim.cpp` (torch.autocast for CPU and CUDA), `varlen_shim.cpp` (FlashAttention's
//! varlen kernel for document-causal attention on CUDA), `recompute_shim.cpp` (activation
//! checkpointing: a custom autograd Function that recomputes a region in backward) and
//! `function_shim.cpp` (custom autograd Functions written in Rust) and `memory_shim.cpp` (the
//! CUDA caching allocator's statistics, through c10's device-generic interface, so it also
//! compiles against a CPU-only libtorch) and `event_shim.cpp` (timing CUDA events, the same
//! way), as one translation unit (`shims.cpp`), all with one error convention
//! (`cpp/shim_error.h`); the recompute and function shims call Rust back through one ABI
//! (`cpp/rust_callback.h`).
//!
//! Without a libtorch (torch-sys reports none, or it has no headers) the build stops here saying
//! how to get one (scripts/setup.sh, or LIBTORCH), instead of failing later at link time.
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-changed=cpp/shims.cpp");
    println!("cargo:rerun-if-changed=cpp/tcpstore_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/rng_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/grad_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/autocast_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/recompute_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/varlen_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/function_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/memory_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/event_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/shim_error.h");
    println!("cargo:rerun-if-changed=cpp/rust_callback.h");
    // torch-sys reports the libtorch it links; without one the shims cannot be compiled and the
    // link would fail later with a wall of undefined symbols, so stop here saying what to do.
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        fail(
            "torch-sys reported no libtorch (DEP_TCH_LIBTORCH_LIB is unset), so the C++ shims \
             cannot be built",
        );
    };
    // The canonical path: libtorch's own $ORIGIN-relative rpaths to the NVIDIA wheels only
    // resolve from the torch package's real location, not through a symlink.
    let lib = Path::new(&lib_dir);
    let lib = lib.canonicalize().unwrap_or_else(|_| lib.to_path_buf());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    let lib = lib.as_path();
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
    build_torch_shims(lib);
}

/// Stops the build with `why` and how to get a libtorch.
fn fail(why: &str) -> ! {
    panic!(
        "\n\ntitan-train: {why}.\n{}",
        [
            "titan-train builds against the libtorch of a PyTorch install:",
            "- run scripts/setup.sh (it makes .venv with torch and writes .cargo/config.toml with",
            "  LIBTORCH pointing at it), or",
            "- set LIBTORCH to a libtorch directory (with include/ and lib/, e.g. the `torch`",
            "  package folder of a Python environment) and build again.",
        ]
        .join("\n")
    );
}

fn build_torch_shims(lib: &Path) {
    let include = lib.join("../include");
    if !include.join("torch/csrc/api/include").is_dir() {
        fail(&format!(
            "libtorch at {} has no C++ headers at {}",
            lib.display(),
            include.display()
        ));
    }
    // One translation unit that includes every shim (cpp/shims.cpp says why).
    cc::Build::new()
        .cpp(true)
        .file("cpp/shims.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        // libtorch's headers are noisy under -Wall; the shim itself is tiny.
        .warnings(false)
        // Line tables only, as the Rust side's profile: cc's full -g doubled the compile (60 s
        // against 31 s on the 2-core CI machine), the debug info being libtorch's headers'.
        .debug(false)
        .flag("-g1")
        .compile("titan_torch_shims");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}

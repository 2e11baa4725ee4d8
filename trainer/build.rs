//! Embeds libtorch's directory as an rpath so `titan-train` runs without LD_LIBRARY_PATH, and
//! keeps libtorch_cuda linked (the linker would drop it as unused with --as-needed, and then
//! CUDA would silently be unavailable on GPU machines).
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
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
}

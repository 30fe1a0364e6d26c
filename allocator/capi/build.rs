//! Compiles the C++ shim that turns a failed PyTorch allocation into a C++
//! exception (PyTorch turns that into a Python `RuntimeError`).

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    cc::Build::new()
        .cpp(true)
        .file("src/shim.cpp")
        .flag_if_supported("-std=c++17")
        .warnings(true)
        .compile("tidepool_shim");
}

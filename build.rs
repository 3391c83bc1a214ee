//! Stages the Triton kernels (top-level `kernels/*.py`) in OUT_DIR, from where maturin ships them in the wheel
//! as `ironlm.kernels` (`[tool.maturin] include ... from = "out-dir"` in pyproject.toml). maturin's plain
//! `include` keeps a file's path relative to the project root, so without this step the wheel would get a
//! top-level `kernels` package instead. In a source checkout `ironlm/kernels/__init__.py` reads the same
//! files in place. The package's own `__init__.py` comes from python/ironlm/kernels, so it is not copied.

use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("kernels");
    if out.exists() {
        fs::remove_dir_all(&out).expect("clear staged kernels");
    }
    fs::create_dir_all(&out).expect("create OUT_DIR/kernels");
    for entry in fs::read_dir("kernels").expect("read kernels/") {
        let path = entry.expect("list kernels/").path();
        let is_module = path.extension().is_some_and(|e| e == "py");
        if is_module && path.file_name().is_some_and(|n| n != "__init__.py") {
            let name = path.file_name().expect("a file name");
            fs::copy(&path, out.join(name)).expect("stage a kernel");
        }
    }
}

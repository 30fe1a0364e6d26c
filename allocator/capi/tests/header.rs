//! The committed header `include/tidepool.h` must be what cbindgen makes of
//! the sources now. `TIDEPOOL_BLESS=1 cargo test -p tidepool-capi --test header`
//! rewrites it.

use std::path::Path;

#[test]
fn committed_header_is_up_to_date() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    // cbindgen follows the `mod` items of lib.rs to the other sources.
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen failed on the sources");
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let fresh = String::from_utf8(fresh).expect("header is UTF-8");
    let path = dir.join("include/tidepool.h");
    if std::env::var_os("TIDEPOOL_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("write include/tidepool.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/tidepool.h is stale: regenerate it with \
         `TIDEPOOL_BLESS=1 cargo test -p tidepool-capi --test header` and commit it"
    );
}

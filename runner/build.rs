//! Link flags of the `byoc-runner` binary.
//!
//! `-z pack-relative-relocs` (DT_RELR, glibc 2.36+: Debian 12, the AMI's base) stores
//! the position-independent binary's ~73,000 relative relocations in a few KiB instead
//! of 1.7 MiB: the loader reads and applies them at every start, which the daemon pays
//! once but every sandbox helper and policy process pays again, and the table's pages
//! stayed resident in the daemon.
//!
//! `link-order.txt` (release builds, rust-lld: the toolchain's default linker on
//! x86_64 Linux) lists the functions the daemon runs, recorded by
//! `scripts/link-order`; the linker places them first, together. The kernel maps a
//! binary's code in 64 KiB windows around each page touched (fault-around), so with the
//! daemon's functions spread over the 22 MiB of code most of it stayed resident;
//! packed, its resident code is about the size of what it runs. A name the build no
//! longer has (the file is older than the code) is skipped: the layout gets worse, the
//! binary stays correct.
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=link-order.txt");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    let release = std::env::var("PROFILE").as_deref() == Ok("release");
    let lld_by_default = std::env::var("TARGET").as_deref() == Ok("x86_64-unknown-linux-gnu");
    let order = Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default()).join("link-order.txt");
    if release && lld_by_default && order.is_file() {
        println!("cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}", order.display());
        println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    }
}

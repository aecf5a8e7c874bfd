//! Link flags of the `byoc-runner` binary.
//!
//! `-z pack-relative-relocs` (DT_RELR, glibc 2.36+: Debian 12, the AMI's base) stores
//! the position-independent binary's ~73,000 relative relocations in a few KiB instead
//! of 1.7 MiB: the loader reads and applies them at every start, which the daemon pays
//! once but every sandbox helper and policy process pays again, and the table's pages
//! stayed resident in the daemon.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

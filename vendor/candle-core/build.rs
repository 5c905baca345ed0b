//! Tells crates that depend on this candle-core directly that it has the
//! CUDA memory hook (`cuda_backend::hook`): their build scripts see
//! `DEP_CANDLE_CORE_MEMORY_HOOK_VERSION` (not part of candle-core as
//! released; see the workspace's `vendor/README.md`).
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:version=1");
}

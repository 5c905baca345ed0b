//! Sets `cfg(candle_memory_hook)` when the candle-core linked has the CUDA
//! memory hook (`candle_core::cuda_backend::hook`, a patch of the vendored
//! copy; see `vendor/README.md`). Without it, recording CUDA allocations
//! (`--snapshot` / `--plot` on a GPU) is refused.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(candle_memory_hook)");
    println!("cargo::rerun-if-env-changed=DEP_CANDLE_CORE_MEMORY_HOOK_VERSION");
    if std::env::var_os("DEP_CANDLE_CORE_MEMORY_HOOK_VERSION").is_some() {
        println!("cargo::rustc-cfg=candle_memory_hook");
    }
}

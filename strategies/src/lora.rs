//! Low-rank adaptation (LoRA, Hu et al. 2021) on frozen base weights, kept
//! in 16 bits or in 4-bit NormalFloat (QLoRA, Dettmers et al. 2023).
//!
//! Opt-in, because it changes what is trained: a plan carries a [`Lora`]
//! only when the user asked for one (`--lora RANK`). Each targeted linear
//! projection `y = x·Wᵀ` of the blocks becomes
//! `y = x·Wᵀ + (α/r)·(x·Aᵀ)·Bᵀ` with `A` `[r, in]` and `B` `[out, r]` trained
//! and `W` frozen, as PEFT's `LoraLayer` computes it. Only the adapters have
//! gradients, master weights and AdamW moments; every other fix acts on them
//! (accumulation, mixed precision, fused AdamW, ZeRO, offload), while the
//! frozen base weights stay on each device whole.
//!
//! The planner half, [`LoraFix`], moves the frozen weights from 16 bits to
//! NF4 ([`BasePrecision::Nf4`]: 4 bits and an fp32 absmax per block of 64)
//! and then to double-quantized NF4 (the absmax in 8 bits per block of 256),
//! unless the user pinned the base precision; it relaxes the other way.
//! Embeddings, norms and the head stay 16-bit: only the blocks' linear
//! projections are quantized, whether targeted or not (as bitsandbytes'
//! `Linear4bit` replaces every linear layer).
//!
//! Memory ([`Strategy::facts`](crate::Strategy::facts),
//! [`Strategy::memory`](crate::Strategy::memory)): the trained parameters
//! are the adapters ([`adapter_parameters`]); the whole base model is
//! frozen, on the device in its stored form ([`frozen_bytes`]); a pass holds
//! one frozen weight at a time in the compute dtype ([`dequantized_bytes`]),
//! as a frozen matmul dequantizes one weight, multiplies and frees it, in
//! the forward and again for the input gradient.
//!
//! The module's parts, by job (as PEFT splits its `lora` package): the
//! settings ([`Lora`], `config`), the fix and its memory terms (`fix`), the
//! frozen weights (`frozen`, [`nf4`]), the adapted projection and its
//! initialisation and merge (`layer`), and PEFT's names and adapter files
//! (`peft`).
//!
//! ```
//! use oomfix_strategies::lora::{BasePrecision, Lora, LoraFix};
//! use oomfix_strategies::{ModelFacts, Plan, SearchContext, Strategy};
//!
//! // A block of two projections, 64 -> 256 -> 64, in 4 blocks.
//! let facts = ModelFacts::new(4 * 2 * 64 * 256 + 1000, 64 * 256, 4)
//!     .with_linear("up", 64, 256)
//!     .with_linear("down", 256, 64);
//! let lora = Lora::new(8, None, None, BasePrecision::Bf16, &facts)?;
//! assert_eq!(lora.alpha, 16);
//! assert_eq!(lora.targets.names().collect::<Vec<_>>(), ["up", "down"]);
//! assert_eq!(oomfix_strategies::lora::adapter_parameters(&lora, &facts), 4 * 2 * 8 * (64 + 256));
//! assert!(Lora::new(65, None, None, BasePrecision::Bf16, &facts).is_err());
//!
//! let plan = Plan { lora: Some(lora), ..Plan::baseline(8, 128) };
//! let quantized = LoraFix.tighten(&plan, &SearchContext::new(8, 4)).unwrap();
//! assert_eq!(quantized.lora.unwrap().base, BasePrecision::Nf4);
//! # Ok::<(), oomfix_strategies::Error>(())
//! ```

mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod fix;
mod frozen;
mod layer;
pub mod nf4;
mod peft;
#[cfg(test)]
mod testing;

pub use config::{BasePrecision, Lora, Targets, MAX_TARGETS};
pub use fix::{adapter_parameters, dequantized_bytes, frozen_bytes, largest_adapter, LoraFix};
pub use frozen::{FrozenLinear, FrozenWeight, Nf4Weight};
pub use layer::{fresh_adapter, merged_weight, Draw, LoraLinear};
pub use peft::{
    adapter_names, peft_config, peft_name, peft_names, save_peft, SavedAdapter,
    ADAPTER_CONFIG_FILE, ADAPTER_FILE,
};

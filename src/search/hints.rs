//! What would make the closest plan fit when nothing does: a budget, host
//! memory, more GPUs, a shorter sequence, LoRA.

use super::Run;
use crate::memory::Target;
use oomfix_strategies::lora::{BasePrecision, Lora};
use oomfix_strategies::{Plan, SearchContext, Sharding};

/// The LoRA rank the advice of a search that fits nothing tries (PEFT's
/// examples' and the QLoRA paper's common choice).
pub const HINT_LORA_RANK: u32 = 16;

impl Run<'_> {
    /// For a search that trains every parameter: whether the closest plan
    /// would fit with rank-[`HINT_LORA_RANK`] adapters on every linear
    /// projection of the blocks, the base in 16 bits, else in NF4, else in
    /// double-quantized NF4; the flags and the estimated peak.
    fn lora_hint(&self, base: &Plan) -> Option<String> {
        if base.lora.is_some() || !crate::memory::analytic_activations(self.spec) {
            return None;
        }
        let facts = crate::memory::model_facts(self.spec);
        [
            BasePrecision::Bf16,
            BasePrecision::Nf4,
            BasePrecision::Nf4Double,
        ]
        .into_iter()
        .find_map(|precision| {
            let lora = Lora::new(HINT_LORA_RANK, None, None, precision, &facts).ok()?;
            let plan = Plan {
                lora: Some(lora),
                ..*base
            };
            let estimate = self
                .estimator
                .estimate(self.spec, &plan, &self.planner.target);
            let flag = match precision {
                BasePrecision::Bf16 => String::new(),
                other => format!(" --base-precision {other}"),
            };
            self.estimate_fits(&estimate).then(|| {
                format!(
                    "--lora {HINT_LORA_RANK}{flag} would fit ({})",
                    crate::units::format_bytes(estimate.peak)
                )
            })
        })
    }

    /// What would make the closest attempt fit: a budget (or host memory,
    /// when that is what fails), more GPUs (on CUDA, where ranks add device
    /// memory), a shorter sequence, LoRA.
    pub(super) fn advice(&self, ctx: &SearchContext) -> Vec<String> {
        use crate::units::format_bytes;
        let p = self.planner;
        let closest = self
            .attempts
            .iter()
            .min_by_key(|a| a.peak())
            .expect("at least one attempt");
        let needed = closest.peak() + self.headroom.bytes(closest.peak());
        let host_short = p.host_budget.filter(|&h| closest.estimate.host > h);
        let mut advice = Vec::new();
        if closest.ran_out_of_memory() {
            advice.push(format!(
                "the closest plan ran out of memory when measured: it needs more than {} (the estimates below may be low too)",
                format_bytes(p.budget)
            ));
        } else if needed > p.budget {
            advice.push(match host_short {
                None => format!(
                    "a budget of {} would fit the closest plan",
                    format_bytes(needed)
                ),
                Some(_) => format!(
                    "a budget of {} and {} of host memory would fit the closest plan",
                    format_bytes(needed),
                    format_bytes(closest.estimate.host)
                ),
            });
        }
        if let Some(host_budget) = host_short {
            advice.push(format!(
                "host memory is what fails: the closest plan keeps {} on the host (the offloaded \
                 optimizer state or activations) and {} may be used there (--host-budget SIZE; default: the \
                 memory available now)",
                format_bytes(closest.estimate.host),
                format_bytes(host_budget)
            ));
            if let Some(on_device) = self
                .attempts
                .iter()
                .filter(|a| a.estimate.host == 0 && !a.ran_out_of_memory())
                .min_by_key(|a| a.peak())
            {
                advice.push(format!(
                    "without offloading, a budget of {} would fit ({})",
                    format_bytes(on_device.peak() + self.headroom.bytes(on_device.peak())),
                    on_device.plan
                ));
            }
        }
        let fits =
            |plan: &Plan| self.estimate_fits(&self.estimator.estimate(self.spec, plan, &p.target));
        let base = closest.plan;
        // Ranks add device memory on GPUs; on the CPU they share the host's.
        if matches!(p.target, Target::Cuda(_)) {
            let divisors_of_batch = oomfix_strategies::accumulate::divisors(ctx.global_batch);
            if let Some(n) = divisors_of_batch
                .iter()
                .copied()
                .filter(|&n| n > 1)
                .find(|&n| {
                    let per_rank = ctx.global_batch / n;
                    fits(&Plan {
                        micro_batch: 1,
                        grad_accum: per_rank,
                        shard: Sharding {
                            world_size: n,
                            stage: 3,
                            ..base.shard
                        },
                        ..base
                    })
                })
            {
                advice.push(if cfg!(feature = "nccl") {
                    format!("{n} GPUs with ZeRO stage 3 would fit (--gpus {n})")
                } else {
                    format!(
                        "{n} GPUs with ZeRO stage 3 would fit (--gpus {n}); training over them \
                         needs a build with --features nccl"
                    )
                });
            }
        }
        if let Some(hint) = self.lora_hint(&base) {
            advice.push(hint);
        }
        let mut seq = base.seq_len / 2;
        while seq >= 16 {
            if fits(&Plan {
                seq_len: seq,
                ..base
            }) {
                advice.push(format!(
                    "a sequence length of {seq} would fit (--seq-len {seq})"
                ));
                break;
            }
            seq /= 2;
        }
        advice
    }
}

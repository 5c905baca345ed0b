//! LoRA as a fix: the planner half ([`LoraFix`]: the frozen base weights
//! quantized step by step) and LoRA's terms of the training state's bytes
//! (the adapters trained, the frozen base stored, one weight dequantized in
//! a pass).

use super::{BasePrecision, Lora};
use crate::{ModelFacts, Plan, SearchContext, StateBytes, Strategy};

/// Trainable parameters of `lora`'s adapters on the model `facts`
/// describes: `r·(in + out)` per adapted projection, in every block.
pub fn adapter_parameters(lora: &Lora, facts: &ModelFacts) -> u64 {
    let per_block: u64 = lora
        .adapted(facts)
        .map(|l| u64::from(lora.rank) * (l.inputs + l.outputs))
        .sum();
    per_block * facts.layers as u64
}

/// Elements of `lora`'s largest adapter tensor (`A` `[r, in]` or `B` `[out, r]`).
pub fn largest_adapter(lora: &Lora, facts: &ModelFacts) -> u64 {
    lora.adapted(facts)
        .map(|l| u64::from(lora.rank) * l.inputs.max(l.outputs))
        .max()
        .unwrap_or(0)
}

/// Device bytes of the frozen base weights of a model of `facts` (after
/// [`Strategy::facts`]: `frozen` parameters, the blocks' projections among
/// them) stored as `base` under a compute dtype of `compute_bytes` per
/// value: the blocks' linear weights in `base`'s form (NF4), everything
/// else (embeddings, norms, biases, the head), and the projections of a
/// [`BasePrecision::Bf16`] base, in the compute dtype.
pub fn frozen_bytes(base: BasePrecision, compute_bytes: u64, facts: &ModelFacts) -> u64 {
    let layers = facts.layers as u64;
    let linear: u64 = facts.linears().map(|l| l.inputs * l.outputs).sum::<u64>() * layers;
    if !base.is_quantized() {
        return compute_bytes * facts.frozen;
    }
    let others = facts.frozen.saturating_sub(linear);
    let quantized: u64 = facts
        .linears()
        .map(|l| base.weight_bytes(l.inputs * l.outputs))
        .sum::<u64>()
        * layers;
    compute_bytes * others + quantized
}

/// Bytes of the one frozen weight a pass of `plan` holds in the compute
/// dtype at a time: with an NF4 base, the largest block projection
/// dequantized; else none (weights in the compute dtype are used as
/// stored).
pub fn dequantized_bytes(plan: &Plan, lora: &Lora, facts: &ModelFacts) -> u64 {
    let largest_linear = facts
        .linears()
        .map(|l| l.inputs * l.outputs)
        .max()
        .unwrap_or(0);
    if lora.base.is_quantized() {
        plan.precision.compute_bytes() * largest_linear
    } else {
        0
    }
}

/// The base precisions [`LoraFix`] steps through, from the largest.
const BASES: [BasePrecision; 3] = [
    BasePrecision::Bf16,
    BasePrecision::Nf4,
    BasePrecision::Nf4Double,
];

/// `plan` with its LoRA's base `by` steps along [`BASES`] (`None` without a
/// LoRA or past either end).
fn with_base_step(plan: &Plan, by: isize) -> Option<Plan> {
    let lora = plan.lora?;
    let at = BASES.iter().position(|b| *b == lora.base)?;
    let base = *BASES.get(at.checked_add_signed(by)?)?;
    Some(Plan {
        lora: Some(Lora { base, ..lora }),
        ..*plan
    })
}

/// Planner half of LoRA: for a plan that carries a [`Lora`] (the user's
/// choice; the fix never adds one), quantizes the frozen base weights
/// bf16 → nf4 → nf4-dq, and relaxes back.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoraFix;

impl Strategy for LoraFix {
    fn name(&self) -> &'static str {
        "lora"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        with_base_step(plan, 1)
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        with_base_step(plan, -1)
    }
    /// The adapters are what is trained; the whole base model is frozen.
    fn facts(&self, plan: &Plan, facts: &mut ModelFacts) {
        let Some(lora) = plan.lora else { return };
        facts.frozen += facts.parameters;
        facts.largest_frozen = facts.largest_frozen.max(facts.largest_tensor);
        facts.parameters = adapter_parameters(&lora, facts);
        facts.largest_tensor = largest_adapter(&lora, facts);
        facts.block_parameters = facts.parameters / (facts.layers.max(1) as u64);
    }
    /// The frozen weights on every device (after the other fixes set the
    /// adapters' terms: ZeRO shards and offload moves adapters' state, never
    /// the frozen weights) but a token embedding only looked up, which is
    /// host memory ([`ModelFacts::looked_up`]), and one weight at a time
    /// dequantized in a pass.
    fn memory(&self, plan: &Plan, model: &ModelFacts, state: &mut StateBytes) {
        let Some(lora) = plan.lora else { return };
        let frozen = frozen_bytes(lora.base, plan.precision.compute_bytes(), model);
        // A token embedding only looked up stays in host memory; the rows a
        // pass looks up are sent over.
        let on_host = (plan.precision.compute_bytes() * model.looked_up).min(frozen);
        state.weights += frozen - on_host;
        state.step_weights += frozen - on_host;
        state.host += on_host;
        state.pass_transient = state
            .pass_transient
            .max(dequantized_bytes(plan, &lora, model));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::testing::llama3_8b;
    use crate::memory::state_of;
    use crate::Precision;

    #[test]
    fn llama3_8b_counts() {
        let facts = llama3_8b();
        assert_eq!(facts.parameters, 8_030_261_248);
        let lora = Lora::new(16, None, None, BasePrecision::Nf4, &facts).unwrap();
        // PEFT's print_trainable_parameters for r=16 all-linear on Llama-3-8B.
        assert_eq!(adapter_parameters(&lora, &facts), 41_943_040);
        let only_qv = Lora::new(
            16,
            None,
            Some(&["q_proj", "v_proj"]),
            BasePrecision::Bf16,
            &facts,
        )
        .unwrap();
        assert_eq!(
            adapter_parameters(&only_qv, &facts),
            32 * 16 * (4096 + 4096 + 4096 + 1024)
        );
    }

    #[test]
    fn the_plan_carries_it_in_its_json() {
        let facts = llama3_8b();
        let lora = Lora::new(
            16,
            Some(8),
            Some(&["v_proj", "q_proj"]),
            BasePrecision::Nf4,
            &facts,
        )
        .unwrap();
        let plan = Plan {
            lora: Some(lora),
            ..Plan::baseline(8, 128)
        };
        let json = serde_json::to_string(&plan).unwrap();
        assert!(
            json.ends_with(
                r#""lora":{"rank":16,"alpha":8,"targets":["v_proj","q_proj"],"base":"nf4"}}"#
            ),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
        // A plan without LoRA keeps its encoding.
        assert!(!serde_json::to_string(&Plan::baseline(8, 128))
            .unwrap()
            .contains("lora"));
    }

    #[test]
    fn frozen_weights_have_no_gradients_nor_state() {
        let facts = llama3_8b();
        let fixes = crate::builtins();
        let lora = Lora::new(16, None, None, BasePrecision::Bf16, &facts).unwrap();
        let plan = Plan {
            precision: Precision::Bf16,
            optimizer: crate::OptimizerImpl::FusedAdamW,
            lora: Some(lora),
            ..Plan::baseline(8, 128)
        };
        let (trained, s) = state_of(&plan, &facts, &fixes);
        let a = 41_943_040u64;
        assert_eq!(trained.parameters, a);
        assert_eq!(trained.frozen, facts.parameters);
        assert_eq!(s.gradients, 2 * a);
        assert_eq!(s.master_weights, 4 * a);
        assert_eq!(s.optimizer_state, 8 * a);
        assert_eq!(s.weights, 2 * a + 2 * facts.parameters);
        assert_eq!(s.pass_transient, 0);
        // NF4: the blocks' projections in 4 bits and an fp32 absmax per 64;
        // embeddings, head and norms in 16 bits; one projection dequantized.
        let nf4 = Plan {
            lora: Some(Lora {
                base: BasePrecision::Nf4,
                ..lora
            }),
            ..plan
        };
        let (_, q) = state_of(&nf4, &facts, &fixes);
        let linears = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336u64);
        let others = facts.parameters - linears;
        assert_eq!(
            q.weights,
            2 * a + 2 * others + linears / 2 + linears / 64 * 4
        );
        assert_eq!(q.pass_transient, 2 * 4096 * 14336);
        // 5.69 GiB: about 4.5 bits per projection weight beside 16-bit
        // embeddings and head (1.05 billion values).
        let gib = q.weights as f64 / (1u64 << 30) as f64;
        assert!((5.6..5.8).contains(&gib), "{gib} GiB");
    }

    #[test]
    fn the_base_is_quantized_step_by_step_and_relaxed_back() {
        let facts = llama3_8b();
        let ctx = SearchContext::new(8, 32);
        let lora = Lora::new(16, None, None, BasePrecision::Bf16, &facts).unwrap();
        let mut plan = Plan {
            lora: Some(lora),
            ..Plan::baseline(8, 128)
        };
        let mut seen = vec![];
        while let Some(next) = LoraFix.tighten(&plan, &ctx) {
            plan = next;
            seen.push(plan.lora.unwrap().base);
        }
        assert_eq!(seen, [BasePrecision::Nf4, BasePrecision::Nf4Double]);
        let relaxed = LoraFix.relax(&plan, &ctx).unwrap();
        assert_eq!(relaxed.lora.unwrap().base, BasePrecision::Nf4);
        // Never on a plan without LoRA.
        let full = Plan::baseline(8, 128);
        assert!(LoraFix.tighten(&full, &ctx).is_none());
        assert!(LoraFix.relax(&full, &ctx).is_none());
        let (_, unchanged) = state_of(&full, &facts, &crate::builtins());
        assert_eq!(unchanged.weights, 4 * facts.parameters);
    }
}

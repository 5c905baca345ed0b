//! The checkpointing mechanism on a small stack of `candle_nn::Linear` + tanh blocks.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use oomfix_strategies::checkpoint::{self, Block, Gradients};
use oomfix_strategies::compare::rel_diff;
use oomfix_strategies::{Checkpointing, SegmentInputs};

const WIDTH: usize = 16;
const BLOCKS: usize = 5;

struct TanhLinear(Linear);

impl Block for TanhLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)?.tanh()
    }
}

/// A stem (input projection), five blocks and a regression head, with all parameters.
struct Stack {
    input: Tensor,
    target: Tensor,
    stem: Linear,
    blocks: Vec<TanhLinear>,
    head: Linear,
    vars: Vec<Var>,
}

impl Stack {
    fn new() -> candle_core::Result<Self> {
        Self::on(&Device::Cpu)
    }

    fn on(dev: &Device) -> candle_core::Result<Self> {
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, dev);
        let stem = linear(8, WIDTH, vb.pp("stem"))?;
        let blocks = (0..BLOCKS)
            .map(|i| linear(WIDTH, WIDTH, vb.pp(format!("block{i}"))).map(TanhLinear))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let head = linear(WIDTH, 3, vb.pp("head"))?;
        let vars = map.all_vars();
        assert_eq!(vars.len(), 2 * (BLOCKS + 2));
        let input = Tensor::randn(0f32, 1.0, (4, 6, 8), dev)?;
        let target = Tensor::randn(0f32, 1.0, (4, 6, 3), dev)?;
        Ok(Stack {
            input,
            target,
            stem,
            blocks,
            head,
            vars,
        })
    }

    fn backward(
        &self,
        policy: Checkpointing,
        loss_scale: f64,
    ) -> oomfix_strategies::Result<Gradients> {
        self.backward_keeping(policy, SegmentInputs::OnDevice, loss_scale)
    }

    /// [`checkpoint::backward_with`], the segments' inputs kept as `inputs` says.
    fn backward_keeping(
        &self,
        policy: Checkpointing,
        inputs: SegmentInputs,
        loss_scale: f64,
    ) -> oomfix_strategies::Result<Gradients> {
        self.backward_from(self.stem.forward(&self.input)?, policy, inputs, loss_scale)
    }

    /// [`backward_keeping`](Self::backward_keeping) from `stem`.
    fn backward_from(
        &self,
        stem: Tensor,
        policy: Checkpointing,
        inputs: SegmentInputs,
        loss_scale: f64,
    ) -> oomfix_strategies::Result<Gradients> {
        let head = |x: &Tensor| candle_nn::loss::mse(&self.head.forward(x)?, &self.target);
        let (vars, hook) = (&self.vars, &mut checkpoint::NoHook);
        checkpoint::backward_with(
            stem,
            &self.blocks,
            head,
            vars,
            policy,
            inputs,
            loss_scale,
            hook,
        )
    }
}

/// Segment inputs kept on the host give the loss and gradients of those
/// kept on the device, bit for bit, for every segment length.
fn offloaded_inputs_change_nothing(dev: &Device) {
    let stack = Stack::on(dev).unwrap();
    for k in [1, 2, 5] {
        let policy = Checkpointing::Every(k);
        let here = stack.backward(policy, 1.0).unwrap();
        let host = stack
            .backward_keeping(policy, SegmentInputs::OnHost, 1.0)
            .unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(
            bits(&here.loss.reshape(1).unwrap()),
            bits(&host.loss.reshape(1).unwrap())
        );
        for (i, (a, b)) in grads(&here).into_iter().zip(grads(&host)).enumerate() {
            assert_eq!(bits(a), bits(b), "Every({k}): var {i}");
            assert!(b.device().same_device(dev));
        }
    }
}

#[test]
fn offloaded_segment_inputs_give_the_same_gradients() {
    offloaded_inputs_change_nothing(&Device::Cpu);
}

/// A stem with no graph (frozen embeddings, as under LoRA) is offloaded with
/// the other inputs and comes back as it was: the same loss and gradients,
/// bit for bit.
fn an_offloaded_frozen_stem_changes_nothing(dev: &Device) {
    let stack = Stack::on(dev).unwrap();
    let stem = stack.stem.forward(&stack.input).unwrap().detach();
    for k in [1, 2, 5] {
        let policy = Checkpointing::Every(k);
        let [here, host] = [SegmentInputs::OnDevice, SegmentInputs::OnHost].map(|inputs| {
            stack
                .backward_from(stem.clone(), policy, inputs, 1.0)
                .unwrap()
        });
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(
            bits(&here.loss.reshape(1).unwrap()),
            bits(&host.loss.reshape(1).unwrap())
        );
        for (i, (a, b)) in here.grads.iter().zip(&host.grads).enumerate() {
            match (a, b) {
                (Some(a), Some(b)) => assert_eq!(bits(a), bits(b), "Every({k}): var {i}"),
                (None, None) => {}
                _ => panic!("Every({k}): var {i} has a gradient on one side only"),
            }
        }
    }
}

#[test]
fn an_offloaded_frozen_stem_gives_the_same_gradients() {
    an_offloaded_frozen_stem_changes_nothing(&Device::Cpu);
}

/// On a CUDA device the inputs really go to host memory and back.
#[cfg(feature = "cuda")]
#[test]
fn offloaded_segment_inputs_give_the_same_gradients_on_cuda() {
    offloaded_inputs_change_nothing(&Device::new_cuda(0).unwrap());
    an_offloaded_frozen_stem_changes_nothing(&Device::new_cuda(0).unwrap());
}

fn grads(g: &Gradients) -> Vec<&Tensor> {
    g.grads
        .iter()
        .map(|g| g.as_ref().expect("every parameter has a gradient"))
        .collect()
}

#[test]
fn checkpoint_gradients_match_plain_backward() {
    let stack = Stack::new().unwrap();
    let plain = stack.backward(Checkpointing::None, 1.0).unwrap();
    for g in grads(&plain) {
        assert!(
            g.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
    }
    // 1: every block; 2: segments 0..2, 2..4, 4..5; 5 and 9: one segment of all blocks.
    for k in [1, 2, 5, 9] {
        let ckpt = stack.backward(Checkpointing::Every(k), 1.0).unwrap();
        let (a, b) = (
            ckpt.loss.to_scalar::<f32>().unwrap(),
            plain.loss.to_scalar::<f32>().unwrap(),
        );
        assert_eq!(a, b, "Every({k}) loss");
        for (i, (c, p)) in grads(&ckpt).into_iter().zip(grads(&plain)).enumerate() {
            let rel = rel_diff(c, p).unwrap();
            assert!(rel < 1e-5, "Every({k}): var {i} differs by {rel:e}");
        }
    }
}

#[test]
fn checkpoint_loss_scale_scales_gradients_not_the_loss() {
    let stack = Stack::new().unwrap();
    let plain = stack.backward(Checkpointing::None, 1.0).unwrap();
    for policy in [Checkpointing::None, Checkpointing::Every(2)] {
        let scaled = stack.backward(policy, 1024.0).unwrap();
        assert_eq!(
            scaled.loss.to_scalar::<f32>().unwrap(),
            plain.loss.to_scalar::<f32>().unwrap()
        );
        for (s, p) in grads(&scaled).into_iter().zip(grads(&plain)) {
            let unscaled = (s / 1024.0).unwrap();
            assert!(rel_diff(&unscaled, p).unwrap() < 1e-5, "{policy}");
        }
    }
}

#[test]
fn checkpoint_results_hold_no_graph() {
    let stack = Stack::new().unwrap();
    for policy in [
        Checkpointing::None,
        Checkpointing::Every(1),
        Checkpointing::Every(3),
    ] {
        let out = stack.backward(policy, 2.0).unwrap();
        assert!(!out.loss.track_op(), "{policy}: loss is attached");
        for g in grads(&out) {
            assert!(!g.track_op(), "{policy}: a gradient is attached");
        }
    }
}

#[test]
fn checkpoint_unused_variables_get_no_gradient() {
    let stack = Stack::new().unwrap();
    let unused = Var::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
    let mut vars = stack.vars.clone();
    vars.push(unused);
    let stem = stack.stem.forward(&stack.input).unwrap();
    // This head does not use the head layer's parameters either.
    let head = |x: &Tensor| x.sqr()?.mean_all();
    let head_ids = [stack.head.weight().id(), stack.head.bias().unwrap().id()];
    for policy in [Checkpointing::None, Checkpointing::Every(2)] {
        let out = checkpoint::backward(&stem, &stack.blocks, head, &vars, policy, 1.0).unwrap();
        for (v, g) in vars.iter().zip(&out.grads) {
            let used = !head_ids.contains(&v.as_tensor().id()) && v.dims() != [2, 2];
            assert_eq!(g.is_some(), used, "{policy}");
        }
    }
}

#[test]
fn checkpoint_head_that_ignores_the_blocks_is_an_error() {
    let stack = Stack::new().unwrap();
    let stem = stack.stem.forward(&stack.input).unwrap();
    let w = stack.vars[0].as_tensor().clone();
    let head = move |_: &Tensor| w.sqr()?.sum_all();
    let err = checkpoint::backward(
        &stem,
        &stack.blocks,
        head,
        &stack.vars,
        Checkpointing::Every(1),
        1.0,
    );
    assert!(err.is_err());
}

#[test]
fn checkpoint_segments_cover_the_blocks_in_order() {
    for layers in 0..10 {
        for k in 1..12 {
            let segs = Checkpointing::Every(k).segments(layers);
            let flat: Vec<usize> = segs.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(flat, (0..layers).collect::<Vec<_>>());
            assert!(segs.iter().all(|r| !r.is_empty() && r.len() <= k));
            assert_eq!(segs.len(), layers.div_ceil(k));
        }
        assert!(Checkpointing::Every(0).segments(layers).is_empty());
    }
}

//! What LoRA's adapted projection holds on the CPU, counted by the global
//! allocator: its forward keeps its input and output only (no dequantized
//! weight), and converts one frozen weight at a time in the forward and in
//! the backward, as the memory model counts it; a composed projection on the
//! same NF4 weights keeps every dequantized weight until the backward.
//!
//! One test: the allocator's counters are process-wide.

use candle_core::{DType, Device, Tensor, Var};
use oomfix::strategies::lora::{BasePrecision, LoraLinear};
use oomfix::track::alloc::{current, peak, reset_peak};
use oomfix::track::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Small allocations besides the tensors: graph nodes, shapes, op structs.
const SLACK: u64 = 256 << 10;

#[test]
fn the_adapted_projection_keeps_its_input_and_converts_one_weight_at_a_time() {
    let dev = Device::Cpu;
    let (layers, n, d, r) = (6usize, 256usize, 512usize, 8usize);
    let stack: Vec<LoraLinear> = (0..layers)
        .map(|_| {
            let w = Tensor::randn(0f32, 0.05, (d, d), &dev).unwrap();
            LoraLinear::new(&w, None, r, 16.0, BasePrecision::Nf4).unwrap()
        })
        .collect();
    let x = Var::randn(0f32, 1.0, (n, d), &dev).unwrap();
    let (w_bytes, y_bytes) = ((d * d * 4) as u64, (n * d * 4) as u64);

    let fused = |x: &Tensor| {
        stack
            .iter()
            .try_fold(x.clone(), |h, l| l.forward(&h))
            .unwrap()
    };
    let composed = |x: &Tensor| {
        stack.iter().fold(x.clone(), |h, l| {
            let w = l.frozen().weight(DType::F32).unwrap();
            let t = h.matmul(&l.a().as_tensor().t().unwrap()).unwrap();
            let u = t.matmul(&l.b().as_tensor().t().unwrap()).unwrap();
            (h.matmul(&w.t().unwrap()).unwrap() + u.affine(l.scale(), 0.0).unwrap()).unwrap()
        })
    };
    // Warm up (the thread pool, the matmul kernels' buffers).
    drop(
        fused(x.as_tensor())
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward(),
    );

    let base = reset_peak();
    let loss = fused(x.as_tensor()).sqr().unwrap().sum_all().unwrap();
    let kept = current() - base;
    let forward_peak = peak() - base;
    // Each layer's output is the next one's kept input; the last is kept
    // by the square, whose output the sum keeps.
    assert!(kept >= layers as u64 * y_bytes, "{kept}");
    assert!(kept <= (layers as u64 + 1) * y_bytes + SLACK, "{kept}");
    // While a layer runs: what is kept, one dequantized weight, the output
    // and its copy handed to the graph, x·Aᵀ.
    assert!(
        forward_peak <= kept + w_bytes + 2 * y_bytes + SLACK,
        "{forward_peak} {kept}"
    );

    let before_backward = reset_peak();
    let grads = loss.backward().unwrap();
    let backward_peak = peak() - before_backward;
    // The backward adds, at most: one dequantized weight, the upstream and
    // input gradients with their partial products (four [n, d]), and the
    // adapters' gradients; never all the weights.
    let adapter_grads = (layers * 2 * r * d * 4) as u64;
    assert!(
        backward_peak <= w_bytes + 4 * y_bytes + adapter_grads + SLACK,
        "{backward_peak}"
    );
    assert!(grads.get(stack[0].a().as_tensor()).is_some());
    drop((grads, loss));

    // A composed stack keeps every dequantized weight until its backward.
    let base = reset_peak();
    let loss = composed(x.as_tensor()).sqr().unwrap().sum_all().unwrap();
    let composed_kept = current() - base;
    assert!(
        composed_kept >= kept + layers as u64 * w_bytes,
        "{composed_kept} {kept}"
    );
    drop(loss);
}

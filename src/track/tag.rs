//! Tags for recorded allocations: which module and op the program is in, and
//! which training-state component a buffer belongs to.
//!
//! The allocator must not allocate while it records, so the current tag is one
//! atomic integer: a [`Module`] (an index into a table of interned
//! `&'static str` paths such as `h.3.attn`, filled when a model is built) and
//! an [`Op`] (a fixed list). [`Scope`] guards set it and restore the previous
//! tag when dropped. The tag is process-wide, not per thread: candle's CPU ops
//! may allocate on rayon worker threads, and those allocations belong to the
//! scope the training thread is in. The trainer runs one step at a time, so
//! scopes nest like the calls that open them.
//!
//! Setting a tag costs one atomic store, recording or not.

use candle_core::{Storage, Tensor};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// A module path interned by [`Module::intern`]; `Module::ROOT` is "no module".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Module(u16);

/// Paths of interned modules; index 0 is the root.
static MODULES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

impl Module {
    /// No module (the trainer itself).
    pub const ROOT: Module = Module(0);

    /// The module named `path` (interned once; later calls with the same path
    /// return the same module without allocating). Call it when building a
    /// model, not in hot code. Past 65,535 distinct paths, new paths map to
    /// the root.
    pub fn intern(path: &str) -> Module {
        let mut table = MODULES.lock().unwrap_or_else(|e| e.into_inner());
        if table.is_empty() {
            table.push("");
        }
        if let Some(i) = table.iter().position(|p| *p == path) {
            return Module(i as u16);
        }
        if table.len() > u16::MAX as usize {
            return Module::ROOT;
        }
        table.push(Box::leak(path.to_string().into_boxed_str()));
        Module(table.len() as u16 - 1)
    }

    /// The module's path (`""` for the root).
    pub fn path(self) -> &'static str {
        let table = MODULES.lock().unwrap_or_else(|e| e.into_inner());
        table.get(self.0 as usize).copied().unwrap_or("")
    }
}

/// What kind of computation allocates: a short fixed list, cheap to set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum Op {
    /// Nothing more specific.
    #[default]
    None = 0,
    /// Building the model's parameters (and fp32 master weights).
    InitWeights,
    /// Building the optimizer (its moments).
    InitOptimizer,
    /// Making a batch of token ids.
    Batch,
    /// An embedding lookup.
    Embedding,
    /// A layer norm.
    LayerNorm,
    /// An RMS norm.
    RmsNorm,
    /// A matrix product (projections, attention scores and context, LM head).
    Matmul,
    /// Rotary position embeddings.
    Rope,
    /// Attention (masks, scaling, merging heads).
    Attention,
    /// A softmax.
    Softmax,
    /// GELU.
    Gelu,
    /// SiLU (SwiGLU's gate).
    Silu,
    /// A residual addition.
    Residual,
    /// The cross-entropy loss.
    Loss,
    /// candle's backward pass.
    Backward,
    /// Summing micro-batch gradients.
    GradAccumulate,
    /// Dividing gradients by the loss scale.
    GradUnscale,
    /// An AdamW update.
    AdamW,
    /// Copying fp32 master weights into the 16-bit compute weights.
    WeightSync,
}

impl Op {
    const ALL: [Op; 20] = [
        Op::None,
        Op::InitWeights,
        Op::InitOptimizer,
        Op::Batch,
        Op::Embedding,
        Op::LayerNorm,
        Op::RmsNorm,
        Op::Matmul,
        Op::Rope,
        Op::Attention,
        Op::Softmax,
        Op::Gelu,
        Op::Silu,
        Op::Residual,
        Op::Loss,
        Op::Backward,
        Op::GradAccumulate,
        Op::GradUnscale,
        Op::AdamW,
        Op::WeightSync,
    ];

    /// Lower-case name (`""` for [`Op::None`]).
    pub fn as_str(self) -> &'static str {
        match self {
            Op::None => "",
            Op::InitWeights => "init_weights",
            Op::InitOptimizer => "init_optimizer",
            Op::Batch => "batch",
            Op::Embedding => "embedding",
            Op::LayerNorm => "layer_norm",
            Op::RmsNorm => "rms_norm",
            Op::Matmul => "matmul",
            Op::Rope => "rope",
            Op::Attention => "attention",
            Op::Softmax => "softmax",
            Op::Gelu => "gelu",
            Op::Silu => "silu",
            Op::Residual => "residual",
            Op::Loss => "loss",
            Op::Backward => "backward",
            Op::GradAccumulate => "grad_accumulate",
            Op::GradUnscale => "grad_unscale",
            Op::AdamW => "adamw",
            Op::WeightSync => "weight_sync",
        }
    }

    fn from_u8(v: u8) -> Op {
        Op::ALL.get(v as usize).copied().unwrap_or(Op::None)
    }

    /// The component that every allocation made under this op holds, where the
    /// op says so: building the model gives weights, building the optimizer
    /// gives optimizer state.
    pub fn component(self) -> Option<Component> {
        match self {
            Op::InitWeights => Some(Component::Weights),
            Op::InitOptimizer => Some(Component::OptimizerState),
            _ => None,
        }
    }
}

/// A module and an op, packed in one integer (the module in the high bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct Tag(u32);

impl Tag {
    /// The tag of `module` and `op`.
    pub fn new(module: Module, op: Op) -> Tag {
        Tag((u32::from(module.0) << 8) | op as u32)
    }

    /// The module.
    pub fn module(self) -> Module {
        Module((self.0 >> 8) as u16)
    }

    /// The op.
    pub fn op(self) -> Op {
        Op::from_u8(self.0 as u8)
    }

    /// `module.op`, `module`, `op`, or `""`, e.g. `h.3.attn.matmul`.
    pub fn name(self) -> String {
        match (self.module().path(), self.op().as_str()) {
            ("", op) => op.to_string(),
            (m, "") => m.to_string(),
            (m, op) => format!("{m}.{op}"),
        }
    }
}

static CURRENT: AtomicU32 = AtomicU32::new(0);

/// The tag now.
#[inline]
pub fn current() -> Tag {
    Tag(CURRENT.load(Ordering::Relaxed))
}

/// Sets the tag without a guard (the enclosing [`Scope`] restores its own on drop).
pub fn set(tag: Tag) {
    CURRENT.store(tag.0, Ordering::Relaxed);
}

/// Sets the tag for its lifetime and restores the previous one when dropped.
#[derive(Debug)]
#[must_use = "the scope ends when the guard is dropped"]
pub struct Scope {
    previous: Tag,
}

impl Scope {
    /// Enters `module` (with no op).
    #[inline]
    pub fn module(module: Module) -> Scope {
        Scope::new(module, Op::None)
    }

    /// Enters `op` within the current module.
    #[inline]
    pub fn op(op: Op) -> Scope {
        Scope::new(current().module(), op)
    }

    /// Enters `module` and `op`.
    #[inline]
    pub fn new(module: Module, op: Op) -> Scope {
        let previous = Tag(CURRENT.swap(Tag::new(module, op).0, Ordering::Relaxed));
        Scope { previous }
    }
}

impl Drop for Scope {
    #[inline]
    fn drop(&mut self) {
        set(self.previous);
    }
}

/// What a buffer of the training state is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Component {
    /// Model parameters and fp32 master weights.
    Weights = 0,
    /// Parameter gradients (per micro-batch and accumulated).
    Gradients = 1,
    /// The optimizer's moments.
    OptimizerState = 2,
    /// Forward outputs still alive when the backward pass starts.
    Activations = 3,
    /// Everything else: short-lived buffers of forward, backward and optimizer.
    Temporaries = 4,
}

impl Component {
    /// All components, bottom to top as the plot stacks them.
    pub const ALL: [Component; 5] = [
        Component::Weights,
        Component::OptimizerState,
        Component::Gradients,
        Component::Activations,
        Component::Temporaries,
    ];

    /// Lower-case name: `weights`, `gradients`, `optimizer_state`, `activations`, `temporaries`.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Weights => "weights",
            Component::Gradients => "gradients",
            Component::OptimizerState => "optimizer_state",
            Component::Activations => "activations",
            Component::Temporaries => "temporaries",
        }
    }

    /// The component numbered `i` (its `as u8` value).
    pub fn from_index(i: u64) -> Option<Component> {
        Some(match i {
            0 => Component::Weights,
            1 => Component::Gradients,
            2 => Component::OptimizerState,
            3 => Component::Activations,
            4 => Component::Temporaries,
            _ => return None,
        })
    }
}

/// The address of a tensor's storage buffer: on the CPU the heap block's,
/// on CUDA (with the `cuda` feature) the device address (`None` on other
/// devices or for an empty buffer). Does not allocate.
pub fn storage_addr(t: &Tensor) -> Option<u64> {
    use candle_core::CpuStorage as C;
    let (storage, _) = t.storage_and_layout();
    #[cfg(feature = "cuda")]
    if let Storage::Cuda(cuda) = &*storage {
        return cuda_addr(cuda);
    }
    let Storage::Cpu(cpu) = &*storage else {
        return None;
    };
    let (ptr, len) = match cpu {
        C::U8(v) | C::F6E2M3(v) | C::F6E3M2(v) | C::F4(v) | C::F8E8M0(v) => {
            (v.as_ptr() as u64, v.capacity())
        }
        C::U32(v) => (v.as_ptr() as u64, v.capacity()),
        C::I16(v) => (v.as_ptr() as u64, v.capacity()),
        C::I32(v) => (v.as_ptr() as u64, v.capacity()),
        C::I64(v) => (v.as_ptr() as u64, v.capacity()),
        C::BF16(v) => (v.as_ptr() as u64, v.capacity()),
        C::F16(v) => (v.as_ptr() as u64, v.capacity()),
        C::F32(v) => (v.as_ptr() as u64, v.capacity()),
        C::F64(v) => (v.as_ptr() as u64, v.capacity()),
        C::F8E4M3(v) => (v.as_ptr() as u64, v.capacity()),
    };
    (len > 0).then_some(ptr)
}

/// The device address of a CUDA storage (`None` when empty).
#[cfg(feature = "cuda")]
fn cuda_addr(s: &candle_core::CudaStorage) -> Option<u64> {
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
    use candle_core::cuda_backend::CudaStorageSlice as S;
    fn of<T>(s: &CudaSlice<T>) -> Option<u64> {
        let (ptr, _sync) = s.device_ptr(s.stream());
        (s.num_bytes() > 0).then_some(ptr)
    }
    match &s.slice {
        S::U8(v) | S::F6E2M3(v) | S::F6E3M2(v) | S::F4(v) | S::F8E8M0(v) => of(v),
        S::U32(v) => of(v),
        S::I16(v) => of(v),
        S::I32(v) => of(v),
        S::I64(v) => of(v),
        S::BF16(v) => of(v),
        S::F16(v) => of(v),
        S::F32(v) => of(v),
        S::F64(v) => of(v),
        S::F8E4M3(v) => of(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        let m = Module::intern("h.0.attn");
        assert_eq!(Module::intern("h.0.attn"), m);
        assert_eq!(m.path(), "h.0.attn");
        let before = current();
        {
            let _a = Scope::module(m);
            assert_eq!(current().module(), m);
            {
                let _b = Scope::op(Op::Softmax);
                assert_eq!(current(), Tag::new(m, Op::Softmax));
                assert_eq!(current().name(), "h.0.attn.softmax");
            }
            assert_eq!(current(), Tag::new(m, Op::None));
        }
        assert_eq!(current(), before);
    }

    #[test]
    fn ops_round_trip() {
        for op in Op::ALL {
            assert_eq!(Tag::new(Module::ROOT, op).op(), op);
        }
        for c in Component::ALL {
            assert_eq!(Component::from_index(c as u64), Some(c));
        }
    }
}

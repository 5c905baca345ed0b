//! The crate's custom candle ops, written once for any number of inputs:
//! an op implements [`Kernel`] for its number of inputs (its forward on
//! each device from the inputs' storages and layouts, and its backward),
//! and [`CustomOp`]`(op)` is the `CustomOp1`, `CustomOp2` or `CustomOp3`
//! that candle's `apply_op1`, `apply_op2` and `apply_op3` take.

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

/// An input of a kernel: its storage and layout.
pub(crate) type Input<'a, S> = (&'a S, &'a Layout);

/// A custom op of `N` inputs.
pub(crate) trait Kernel<const N: usize> {
    /// The op's name, as candle's errors give it.
    fn name(&self) -> &'static str;

    /// The output on the CPU, and its shape.
    fn cpu_fwd(&self, inputs: [Input<'_, CpuStorage>; N]) -> Result<(CpuStorage, Shape)>;

    /// The output on a CUDA device, and its shape.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, inputs: [Input<'_, CudaStorage>; N]) -> Result<(CudaStorage, Shape)>;

    /// The inputs' gradients from the output `y` and its gradient `dy`; by
    /// default none (an op applied without backward).
    fn bwd(&self, inputs: [&Tensor; N], y: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; N]> {
        let _ = (inputs, y, dy);
        Err(candle_core::Error::BackwardNotSupported { op: self.name() })
    }
}

/// A [`Kernel`] as candle's custom op of as many inputs.
pub(crate) struct CustomOp<K>(pub(crate) K);

/// `$trait` (`CustomOp1`, `2` or `3`) for a [`Kernel`] of as many inputs,
/// its storages `$s`, layouts `$l`, tensors `$x` and their gradients `$dx`.
macro_rules! custom_op {
    (@grad $x:ident) => { Option<Tensor> };
    ($trait:ident, $n:literal, $(($s:ident, $l:ident, $x:ident, $dx:ident)),+) => {
        impl<K: Kernel<$n>> $trait for CustomOp<K> {
            fn name(&self) -> &'static str {
                self.0.name()
            }

            fn cpu_fwd(&self, $($s: &CpuStorage, $l: &Layout),+) -> Result<(CpuStorage, Shape)> {
                self.0.cpu_fwd([$(($s, $l)),+])
            }

            #[cfg(feature = "cuda")]
            fn cuda_fwd(&self, $($s: &CudaStorage, $l: &Layout),+) -> Result<(CudaStorage, Shape)> {
                self.0.cuda_fwd([$(($s, $l)),+])
            }

            #[allow(unused_parens)]
            fn bwd(&self, $($x: &Tensor,)+ y: &Tensor, dy: &Tensor) -> Result<($(custom_op!(@grad $x)),+)> {
                let [$($dx),+] = self.0.bwd([$($x),+], y, dy)?;
                Ok(($($dx),+))
            }
        }
    };
}

custom_op!(CustomOp1, 1, (s1, l1, a, da));
custom_op!(CustomOp2, 2, (s1, l1, a, da), (s2, l2, b, db));
custom_op!(
    CustomOp3,
    3,
    (s1, l1, a, da),
    (s2, l2, b, db),
    (s3, l3, c, dc)
);

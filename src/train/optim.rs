//! The optimizer a plan asks for, as [`super::Trainer`] holds and steps it.

use crate::track::alloc::mark_tensors;
use crate::track::tag::Component;
use crate::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use oomfix_strategies::accumulate::GradAccumulator;
use oomfix_strategies::adamw::{is_decay_exempt, FusedAdamW};
use oomfix_strategies::clip;
use oomfix_strategies::offload::OffloadedAdamW;
use oomfix_strategies::shard::{Comm, ShardedOptimizer, Traffic, ZeroStage};
use oomfix_strategies::{OptimizerImpl, Plan};

/// The plan's optimizer over the vars it steps (the fp32 masters under
/// mixed precision, unless the optimizer keeps its own).
pub(crate) enum Optim {
    /// One `candle_nn::AdamW` per tensor (with the var it updates), so each is
    /// stepped and its gradient freed in turn.
    Candle(Vec<(AdamW, Var)>),
    Fused(FusedAdamW),
    /// Masters and state in host memory; it writes the compute weights itself.
    Offloaded(OffloadedAdamW),
    /// AdamW over this rank's share of the parameters (world size > 1), on
    /// the device or offloaded.
    Sharded(ShardedOptimizer<Box<dyn Comm>>),
}

impl Optim {
    /// The optimizer of `plan` over the named `vars`: sharded over `comm`
    /// when it has several ranks. Biases and norm scales do not decay
    /// ([`is_decay_exempt`]).
    pub fn new(
        plan: &Plan,
        vars: Vec<(String, Var)>,
        adamw: &ParamsAdamW,
        comm: Option<Box<dyn Comm>>,
    ) -> Result<Self> {
        let adamw = adamw.clone();
        Ok(match (comm, plan.optimizer) {
            (Some(comm), optimizer) if comm.world_size() > 1 => {
                let stage = ZeroStage::try_from(plan.shard.stage)?;
                let vars = vars.into_iter().map(|(_, v)| v).collect();
                let buckets = plan.shard.bucket_bytes;
                let mut opt = if optimizer.is_offloaded() {
                    ShardedOptimizer::offloaded(comm, vars, adamw, stage, buckets)?
                } else {
                    ShardedOptimizer::with_buckets(comm, vars, adamw, stage, buckets)?
                };
                opt.exempt_from_weight_decay(is_decay_exempt);
                Optim::Sharded(opt)
            }
            (_, OptimizerImpl::CandleAdamW) => Optim::Candle(
                vars.into_iter()
                    .map(|(name, v)| {
                        let mut params = adamw.clone();
                        if is_decay_exempt(&name, &v) {
                            params.weight_decay = 0.0;
                        }
                        Ok((AdamW::new(vec![v.clone()], params)?, v))
                    })
                    .collect::<Result<_>>()?,
            ),
            (_, OptimizerImpl::FusedAdamW) => {
                let mut opt = FusedAdamW::new_named(vars, adamw)?;
                opt.exempt_from_weight_decay(is_decay_exempt);
                Optim::Fused(opt)
            }
            (_, OptimizerImpl::OffloadedAdamW) => {
                let mut opt = OffloadedAdamW::new(vars, adamw)?;
                opt.optimizer_mut()
                    .exempt_from_weight_decay(is_decay_exempt);
                Optim::Offloaded(opt)
            }
        })
    }

    /// The fused optimizer whose state a checkpoint holds (none for
    /// candle's; a sharded one's is its rank's share, reached through it).
    pub fn fused(&self) -> Option<&FusedAdamW> {
        match self {
            Optim::Candle(_) | Optim::Sharded(_) => None,
            Optim::Fused(opt) => Some(opt),
            Optim::Offloaded(opt) => Some(opt.optimizer()),
        }
    }

    /// See [`fused`](Self::fused).
    pub fn fused_mut(&mut self) -> Option<&mut FusedAdamW> {
        match self {
            Optim::Candle(_) | Optim::Sharded(_) => None,
            Optim::Fused(opt) => Some(opt),
            Optim::Offloaded(opt) => Some(opt.optimizer_mut()),
        }
    }

    /// Starts a step's gradients: forgets what a failed step summed in `acc`
    /// or reduced.
    pub fn start_gradients(&mut self, acc: &mut GradAccumulator) {
        acc.restart();
        if let Optim::Sharded(opt) = self {
            opt.restart();
        }
    }

    /// Whether each micro-batch's gradients are reduced at once: ZeRO 2 and
    /// 3, so that a rank holds the sums of its own share only.
    fn reduces_each_micro_batch(&self) -> bool {
        matches!(self, Optim::Sharded(opt) if opt.stage() != ZeroStage::OptimizerState)
    }

    /// Takes one micro-batch's gradients (one per var): reduced to their
    /// owners at once at ZeRO 2-3, otherwise summed in `acc`.
    pub fn add_gradients(&mut self, acc: &mut GradAccumulator, grads: Vec<Tensor>) -> Result<()> {
        let each = self.reduces_each_micro_batch();
        match self {
            Optim::Sharded(opt) if each => opt.reduce(grads)?,
            _ => acc.add(grads)?,
        }
        Ok(())
    }

    /// The step's mean gradient over its `micro_batches`: on a sharded plan
    /// this rank's share of it (stage 1 reduces the sums of `acc` here, once).
    pub fn mean_gradients(
        &mut self,
        acc: &mut GradAccumulator,
        micro_batches: usize,
    ) -> Result<Vec<Tensor>> {
        let mean = 1.0 / micro_batches as f64;
        let each = self.reduces_each_micro_batch();
        Ok(match self {
            Optim::Sharded(opt) if each => opt.take_reduced(mean)?,
            Optim::Sharded(opt) => {
                opt.reduce(acc.finish(mean)?)?;
                opt.take_reduced(1.0)?
            }
            _ => acc.finish(mean)?,
        })
    }

    /// What the sharded optimizer's collectives moved and took so far.
    pub fn traffic(&self) -> Traffic {
        match self {
            Optim::Sharded(opt) => opt.traffic(),
            _ => Traffic::default(),
        }
    }

    /// The global L2 norm of the step's gradients: on a sharded plan `grads`
    /// are this rank's share, and the norm is the ranks' together.
    pub fn global_norm(&self, grads: &[Tensor]) -> Result<f64> {
        Ok(match self {
            Optim::Sharded(opt) => opt.global_norm(grads)?,
            _ => clip::global_norm(grads)?,
        })
    }

    /// One step at learning rate `lr` with `grads` (one per var; on a
    /// sharded plan this rank's reduced share) times `factor` (a clip
    /// coefficient; 1: none). Each gradient is freed once it is used.
    pub fn step(
        &mut self,
        grads: Vec<Tensor>,
        lr: f64,
        factor: f64,
        device: &Device,
    ) -> Result<()> {
        match self {
            Optim::Fused(opt) => {
                opt.set_learning_rate(lr);
                opt.step_scaled(&grads, factor)?
            }
            Optim::Offloaded(opt) => {
                opt.optimizer_mut().set_learning_rate(lr);
                opt.step_scaled(grads, factor)?
            }
            Optim::Sharded(opt) => {
                opt.set_learning_rate(lr);
                opt.step_owned(&grads, factor)?
            }
            Optim::Candle(opts) => {
                for ((opt, var), g) in opts.iter_mut().zip(grads) {
                    opt.set_learning_rate(lr);
                    // candle_nn::AdamW reads a GradStore: make one holding this gradient only.
                    let mut store = Tensor::new(0f32, device)?.backward()?;
                    // candle's AdamW takes no factor: this one gradient is scaled
                    // (its unscaled tensor dropped first when it is not shared).
                    let g = match g.to_dtype(DType::F32)? {
                        g32 if factor != 1.0 => {
                            drop(g);
                            g32.affine(factor, 0.0)?
                        }
                        g32 => g32,
                    };
                    mark_tensors([&g], Component::Gradients);
                    store.insert(var.as_tensor(), g);
                    opt.step(&store)?;
                }
            }
        }
        Ok(())
    }
}

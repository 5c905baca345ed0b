//! The longest sequence at which a plan fits, by bisection over whole
//! searches.

use super::{Longest, Planner, SearchResult, Verify, MAX_SEQ_LEN, MAX_TOKENS_PER_STEP};
use crate::spec::ModelSpec;
use crate::Result;

impl Planner {
    /// The longest sequence at which a plan fits, and the search at it.
    ///
    /// Lengths are searched by bisection between 1 and the longest allowed
    /// ([`Longest::upper`]: the model's context, or [`MAX_SEQ_LEN`] with
    /// [`allow_beyond_context`](Self::allow_beyond_context) on a model
    /// without learned positions; at most [`MAX_TOKENS_PER_STEP`] tokens a
    /// step), each by a whole search over every fix on estimates alone; a
    /// plan that fits at a length fits at every shorter one (the estimate
    /// grows with the length). The search at the length found is then run
    /// as configured, a verifier included; when it measures no fitting plan
    /// there, the result says so. When not even one token fits, the result
    /// is the search at one token.
    ///
    /// ```
    /// use oomfix::{ModelSpec, Planner, Target};
    ///
    /// let spec = ModelSpec::default_model(); // GPT-2 small: 1,024 positions
    /// let result = Planner::new(2 << 30).global_batch(1).target(Target::Cuda(0)).longest(&spec)?;
    /// let longest = result.longest.as_ref().unwrap();
    /// assert_eq!(longest.seq_len, Some(1024)); // the whole context fits in 2 GiB
    /// assert_eq!(result.chosen().unwrap().plan.seq_len, 1024);
    /// # Ok::<(), oomfix::Error>(())
    /// ```
    pub fn longest(mut self, spec: &ModelSpec) -> Result<SearchResult> {
        let max = spec.config.max_positions;
        let context =
            if max == 0 || (self.beyond_context && !spec.config.family.has_learned_positions()) {
                MAX_SEQ_LEN
            } else {
                max.min(MAX_SEQ_LEN)
            };
        let per_step = (MAX_TOKENS_PER_STEP / self.global_batch.max(1) as u64) as usize;
        let upper = context.min(per_step).max(1);
        let verifier = self.verifier.take();
        let verify = std::mem::replace(&mut self.verify, Verify::Off);
        let mut trail = Vec::new();
        let mut fits_at = |planner: &mut Planner, n: usize| -> Result<bool> {
            planner.seq_len = Some(n);
            let _span = tracing::info_span!("longest", seq_len = n).entered();
            let fits = planner.run(spec)?.fits();
            trail.push((n, fits));
            Ok(fits)
        };
        let found = if fits_at(&mut self, upper)? {
            Some(upper)
        } else if upper == 1 || !fits_at(&mut self, 1)? {
            None
        } else {
            // Invariant: `lo` fits, `hi` does not.
            let (mut lo, mut hi) = (1, upper);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if fits_at(&mut self, mid)? {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            Some(lo)
        };
        tracing::info!(upper, longest = ?found, probes = trail.len(), "longest sequence searched");
        self.seq_len = Some(found.unwrap_or(1));
        self.verifier = verifier;
        self.verify = verify;
        let mut result = self.run(spec)?;
        result.longest = Some(Longest {
            upper,
            seq_len: found,
            trail,
        });
        Ok(result)
    }
}

//! A recorded allocation timeline written to the `--snapshot` and `--plot`
//! files: of a plan measured apart (`plan`) or of a run's own first steps
//! (`train`).

use super::args::PlanOptions;
use super::{logging, Failure};
use oomfix::report::{self, PlotFormat};
use oomfix::Error;
use std::path::Path;

/// Writes `timeline` to the `--snapshot` and `--plot` files `opts` names
/// (`plot` the plot's format), each atomically; with `rank`, as
/// `NAME.rankR.EXT` (one file per rank of a job).
pub fn write_timeline(
    opts: &PlanOptions,
    plot: Option<PlotFormat>,
    timeline: &oomfix::measure::Timeline,
    budget: u64,
    title: &str,
    rank: Option<usize>,
) -> Result<(), Failure> {
    let named = |path: &Path| match rank {
        None => path.to_path_buf(),
        Some(r) => {
            let stem = path.file_stem().unwrap_or_default().to_string_lossy();
            let name = match path.extension() {
                Some(ext) => format!("{stem}.rank{r}.{}", ext.to_string_lossy()),
                None => format!("{stem}.rank{r}"),
            };
            path.with_file_name(name)
        }
    };
    if let Some(pool) = &timeline.pool {
        tracing::info!(
            pool_used_high = pool.used_high,
            pool_reserved_high = pool.reserved_high,
            at_peak_used = pool.at_used_peak().used,
            at_peak_reserved = pool.at_used_peak().reserved,
            outside_pool_bytes = pool.outside,
            "recorded CUDA pool"
        );
        logging::say(format_args!("oomfix: {}", pool.summary()));
    }
    if let Some(path) = &opts.snapshot {
        let path = named(path);
        let bytes = report::snapshot_pickle(timeline);
        oomfix::output::write_atomic(&path, |f| write_all(f, &path, &bytes))?;
    }
    if let (Some(path), Some(format)) = (&opts.plot, plot) {
        let path = named(path);
        let image = report::timeline_plot(timeline, budget, title, format).map_err(Failure::Run)?;
        oomfix::output::write_atomic(&path, |f| write_all(f, &path, &image))?;
    }
    Ok(())
}

fn write_all(f: &mut std::fs::File, path: &Path, bytes: &[u8]) -> oomfix::Result<()> {
    use std::io::Write;
    f.write_all(bytes).map_err(|e| Error::Io {
        context: format!("writing {}", path.display()),
        source: e,
    })
}

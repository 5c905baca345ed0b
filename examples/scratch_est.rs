use oomfix::measure::{measure_plan, CountingAlloc};
use oomfix::{Estimator, MemoryModel, ModelConfig, ModelSpec, Target};
#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;
fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a[1] == "gpu" {
        // re-estimate the rows of a GPU accuracy JSON
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&a[2]).unwrap()).unwrap();
        let models: std::collections::HashMap<&str, ModelConfig> = [
            ("gpt2-6l", ModelConfig::gpt2(6, 768, 12)),
            ("gpt2-small", ModelConfig::gpt2_small()),
            ("gpt2-medium", ModelConfig::gpt2_medium()),
            (
                "llama-160m",
                ModelConfig::llama(12, 768, 12, 4, 2048, 32000, false),
            ),
            (
                "llama-400m",
                ModelConfig::llama(16, 1024, 16, 8, 2816, 32000, false),
            ),
        ]
        .into_iter()
        .collect();
        let mut errs = vec![];
        for r in d["rows"].as_array().unwrap() {
            let spec = ModelSpec::from_config("x", models[r["model"].as_str().unwrap()].clone());
            let ps = r["plan"].as_str().unwrap();
            // parse display form
            let w: Vec<&str> = ps.split(", ").collect();
            let mbacc: Vec<&str> = w[0].split_whitespace().collect();
            let mb = mbacc[1];
            let acc = mbacc[3];
            let seq = w[1].trim_start_matches("seq ");
            let prec = w[2];
            let ck = if w[3].contains("every block") {
                "1"
            } else {
                "0"
            };
            let opt = w.last().unwrap();
            let att = if ps.contains("flash") {
                "flash"
            } else {
                "composed"
            };
            let arg = format!("{mb},{acc},{seq},{prec},{ck},{opt},{att}");
            let plan = oomfix::measure::parse_plan_arg(&arg).unwrap();
            let est = MemoryModel.estimate(&spec, &plan, &Target::Cuda(0));
            let meas = r["measured_bytes"].as_f64().unwrap();
            let e = est.peak as f64 / meas - 1.0;
            errs.push(e.abs());
            println!(
                "{:<12} {arg:<40} old {:+6.1}% new {:+6.1}%",
                r["model"].as_str().unwrap(),
                100.0 * r["relative_error"].as_f64().unwrap(),
                100.0 * e
            );
        }
        errs.sort_by(f64::total_cmp);
        println!(
            "median {:.1}% max {:.1}%",
            100.0 * errs[errs.len() / 2],
            100.0 * errs.last().unwrap()
        );
        return;
    }
    let cfg: ModelConfig = serde_json::from_str(&a[1]).unwrap();
    let spec = ModelSpec::from_config("x", cfg);
    for p in &a[2..] {
        let plan = oomfix::measure::parse_plan_arg(p).unwrap();
        let est = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
        let m = measure_plan(&spec, &plan, Target::Cpu).unwrap();
        println!(
            "{p}: est {} meas {} err {:+.1}% phase {}\n  {:?}",
            est.peak,
            m.peak_bytes,
            100.0 * (est.peak as f64 / m.peak_bytes as f64 - 1.0),
            est.peak_phase,
            est
        );
    }
}

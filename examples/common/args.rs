//! The command line of the examples: `--flag` switches and `--option VALUE`
//! pairs, in any order.
#![allow(dead_code)] // each example uses a subset

/// The arguments an example was run with.
pub struct Args(Vec<String>);

impl Args {
    /// This process's arguments.
    pub fn from_env() -> Args {
        Args(std::env::args().collect())
    }

    /// The value after `option`, where it is given.
    pub fn value(&self, option: &str) -> Option<String> {
        let at = self.0.iter().position(|a| a == option)?;
        self.0.get(at + 1).cloned()
    }

    /// Whether `flag` is given.
    pub fn has(&self, flag: &str) -> bool {
        self.0.iter().any(|a| a == flag)
    }
}

//! Tenants' token budgets (issue 23): the state behind each budget key,
//! shared by every pool of the process. Placeholder until the wiring lands.

/// Every budget this replica knows (or reaches through its store).
#[derive(Debug, Default)]
pub struct Budgets {}

impl Budgets {
    /// Budgets kept in this process.
    pub fn memory() -> Self {
        Budgets {}
    }
}

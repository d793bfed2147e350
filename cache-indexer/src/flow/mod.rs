//! A pool's flow control (issue 23): the queue picks wait in while the pool
//! is saturated. Placeholder until the wiring lands.

use kvasir_flowcontrol::FlowControlConfig;

/// One pool's flow-control state.
#[derive(Debug)]
pub struct PoolFlow {
    config: FlowControlConfig,
}

impl PoolFlow {
    /// Flow control with `config`.
    pub fn new(config: FlowControlConfig) -> Self {
        PoolFlow { config }
    }

    /// The settings.
    pub fn config(&self) -> &FlowControlConfig {
        &self.config
    }
}

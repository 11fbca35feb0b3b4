"""The core: fully_shard and everything its hot path runs (construction, the hooks, the
schedule, options, strategies, backends, the parameter index, the module state-dict
protocol, the optimizer-step hook and its NaN check). It imports nothing from the layers
above it; they plug in through `extension_points`."""

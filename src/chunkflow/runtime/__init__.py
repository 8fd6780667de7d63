"""Model-agnostic runtime: host store, layout and residency, streamer (prefetch, yield point), hooks, handle."""

"""Model-agnostic runtime: host store (store), block layout and residency (layout), copies and the ring of slots
(streamer), per-block hooks (hooks), pacing around collectives (comm), what observers are told (observe), and the
handle that ties them to one module (handle)."""

"""Model-agnostic runtime: host store (store), block layout and residency (layout), copies and the ring of slots
(streamer), per-block hooks (hooks), what observers are told (observe), and the handle that ties them to one module
(handle). Each feature beyond streaming is a part registered on the handle through one protocol (feature): fp8
storage and casts (casting, with the cast kernel in fp8cast), write watching (writes), pacing around collectives
(comm) and parking (parking)."""

"""Optimizers over the distributed buffers: AdamW on flat fp32 master shards (`DistributedOptimizer`),
Muon with whole matrices per data-parallel rank (`layerwise.LayerWiseMuon`, on the layout of
`layerwise_layout`, math in `muon`, routing in `muon_routing`), the two stepped as one with a joint grad
norm (`chained.ChainedOptimizer`), the global grad norm and clipping, and the LR schedule
(`lr_schedule.lr_at`)."""

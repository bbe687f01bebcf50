"""Optimizers over the distributed buffers: AdamW on flat fp32 master shards (`DistributedOptimizer`),
the global grad norm and clipping, and the LR schedule (`lr_schedule.lr_at`)."""

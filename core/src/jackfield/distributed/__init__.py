"""Several devices: tensor parallelism and decode context parallelism on torch.distributed
(torchrun starts the processes; docs/parallelism.md)."""

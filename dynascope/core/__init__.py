"""The bottom layer: what every part of dynascope may import, and which imports nothing of dynascope.

    errors.py     UserError / StoreError (one-line messages for the user), first_line
    clock.py      now_us: the wall clock every table's µs columns use
    naming.py     tensor names: normalize_name (DDP / torch.compile / FSDP1 wrappers), tensor_kind, tensor_layer
    tensor_io.py  lazy checkpoint reading, streaming safetensors writing, safetensors dtype codes (needs torch)
    extras.py     optional dependencies imported on use, with an error naming the extra to install
    net.py        free_port, for the demo's rendezvous and the dashboard server
    version.py    __version__

Nothing is imported here, so ``import dynascope.core.errors`` costs only that module (tensor_io needs torch).
"""

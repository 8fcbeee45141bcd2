"""Framework integrations, each a thin adapter over ``dynascope.watch`` and the store.

    dynascope.integrations.hf.DynascopeCallback         transformers Trainer / TRL trainers   (extra: hf)
    dynascope.integrations.lightning.DynascopeCallback  PyTorch Lightning                     (extra: lightning)
    dynascope.integrations.wandb.WandbMirror             summaries → the active wandb run      (extra: wandb)
    dynascope.integrations.verl                          verl/OpenRLHF metric dicts, Tracking backend
    dynascope.integrations.ray.actor_scope               probes inside Ray actors              (extra: ray)
    dynascope.integrations.deepspeed.watch               a DeepSpeed ZeRO engine               (extra: deepspeed)

Nothing here is imported by ``import dynascope``; a module whose framework is missing raises an
ImportError that names the extra to install.
"""

"""``deepspeed.zero`` as a script reaches it through ``import lazytrain as deepspeed``: ``Init`` builds the
model whole (LazyTrain partitions at ``initialize``) and ``GatheredParameters`` gathers what LazyTrain
partitions, as ``lazytrain.replace_deepspeed()`` installs them into DeepSpeed itself."""
from .integrations.deepspeed_entry import _GatheredParameters as GatheredParameters
from .integrations.deepspeed_entry import _WholeParameters as Init

__all__ = ["Init", "GatheredParameters"]

"""Storage tiers: where tensors live between uses (device memory, host memory, NVMe, user tiers)."""
from .base import Tier, TierBudgetError, TierError, TransferHandle, format_bytes, parse_bytes
from .factory import TierSpecError, create_tiers
from .memory import DeviceTier, HostTier, MemoryTier, empty_host, pinned_memory_available
from .nvme import NVMeDataError, NVMeIOError, NVMeTier
from .nvme_io import AioSettings
from .pool import SlabPool, empty_aligned
from .registry import register_tier, resolve_tier_class

register_tier("hbm", DeviceTier)
register_tier("host", HostTier)
register_tier("nvme", NVMeTier)

__all__ = ["Tier", "TierBudgetError", "TierError", "TransferHandle", "DeviceTier", "HostTier", "MemoryTier",
           "NVMeTier", "NVMeIOError", "NVMeDataError", "AioSettings", "SlabPool", "empty_aligned", "create_tiers",
           "TierSpecError",
           "register_tier", "resolve_tier_class", "format_bytes", "parse_bytes", "empty_host",
           "pinned_memory_available"]

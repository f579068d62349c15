from .api import attention

__all__ = ["attention"]

"""Model definitions; model names appear only in this package."""

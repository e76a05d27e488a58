"""Test stand-in for SGLang (see tests/fake_sglang/README.md); not the real package."""

__version__ = "0.0.0+slime-test-stand-in"

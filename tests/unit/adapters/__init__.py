"""Unit tests of zerodp.adapters/ (in-process)."""

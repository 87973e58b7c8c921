"""Unit tests of zerodp.moe (in-process)."""

"""Unit tests of zerodp.tools/ (in-process)."""

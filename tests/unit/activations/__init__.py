"""Unit tests of zerodp.activations (in-process, no process group unless a test makes one)."""

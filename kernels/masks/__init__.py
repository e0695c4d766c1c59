"""Masks as data: ``KeyIntervals`` and their key order, the top-W selection from a per-key bias
(with its wavelet matrix), and the packed (varlen) layout. Below the planning, above the device
code."""

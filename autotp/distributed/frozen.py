"""Imported last in the fork server the ranks start from (:func:`autotp.distributed.launch.preload`):
moves every object the server has made so far, the preloaded modules' (torch, transformers, autotp:
some 330-470 thousand), into the collector's permanent generation (:func:`gc.freeze`).

A rank forked from the server inherits them there: its full collections no longer walk them (each
took 0.2-0.4 s in a rank of the test suite, a few a minute while it plans and runs programs), and
its pages of them are not written by the collector's bookkeeping, so they stay shared with the
server. They are the import-time objects of modules a rank keeps for its life: nothing that could
become garbage is frozen.
"""
import gc

gc.freeze()

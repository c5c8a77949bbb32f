"""Verification of a consolidated model: everything that checks what the writer wrote.

The writer (:mod:`fsdp_workflow.consolidate.writer`) is not trusted: every check here
derives what the output should be from the checkpoint again, through a path that shares
nothing with the writer's plan, and records what it found in ``verification.json``.

* :mod:`.expected`: what the output should hold (names, dtypes, shapes, source chunks),
  read from the checkpoint again;
* :mod:`.values`: one output tensor against its source chunks, slab by slab, in bounded
  memory; :mod:`.rounding` where the dtype was cast;
* :mod:`.files`: the output as the ``safetensors`` library reads it, and the index file;
  :mod:`.safetensors_probe` runs that reading in a child process;
* :mod:`.verifier`: :class:`~.verifier.Verifier`, which the consolidation step holds while it
  writes, and which runs the two above;
* :mod:`.architecture`: the written keys against the class config.json names, and the
  ``from_pretrained`` load; :mod:`.architecture_rules` answers for Llama, Mistral and Qwen2
  from config.json alone;
* :mod:`.report_schema`: the shape of ``verification.json``.

This file imports nothing: the copy path (``--no-verify``) and the modules below the
verifier import only the part they need (:mod:`.report_schema` alone costs nothing).
"""

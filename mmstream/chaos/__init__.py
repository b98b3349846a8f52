"""The chaos suite's runner (`mmstream chaos run FILE...`): scenarios as data in
chaos/scenarios/, each run on a pipeline and, where its faults need it, infrastructure of
its own; every invariant of DESIGN.md's delivery section checked afterwards.

- ``scenario``: the scenario file format, loaded and checked;
- ``traffic``: mixed traffic (text, image, video, audio, generate; rt and bulk);
- ``faults``: the fault actions;
- ``infra``: own broker, three-broker cluster, own Redis, Toxiproxy;
- ``checks``: the invariants;
- ``runner``: one scenario from start to result.
"""

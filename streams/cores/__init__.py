"""Engine cores: queues, scheduler and engine thread behind submit / step / cancel, with no
Kafka (the stages in ``streams.stages`` move records in and out of them)."""

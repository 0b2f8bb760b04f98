"""What the stages share over the decoding runtime: the target's states (:mod:`.states`), tensors read from a
checkpoint without loading the model (:mod:`.checkpoint_tensors`, :mod:`.target_shell`), numerics records
(:mod:`.numerics`), SPRINTER's ratio (:mod:`.ratio`) and probability calibration (:mod:`.calibration`)."""

"""`qconv build`: the pipeline that runs the convert, calibrate, eval and kv stages in order (it sits above
all of them, so none of them imports it)."""

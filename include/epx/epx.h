// epx/epx.h — everything public.
#pragma once

#include "epx/a2a.h"
#include "epx/buffer.h"
#include "epx/dispatcher.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/ht.h"
#include "epx/ll.h"
#include "epx/nvfp4.h"
#include "epx/shape.h"
#include "epx/tensor.h"

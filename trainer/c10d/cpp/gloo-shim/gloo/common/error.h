// See ../context.h: declarations only.
#pragma once

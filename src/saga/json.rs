//! A step's result as the JSON that is stored, checked to read back as the
//! same value before the step may commit.
//!
//! serde_json writes `f64::NAN` and the infinities as `null` without an
//! error, so a result can serialize fine and then never deserialize again
//! (or come back as `None` from an `Option<f64>`). A re-execution would
//! then fail, or return something else than the first execution did.

use serde::de::DeserializeOwned;
use serde::ser::{self, Serialize};
use serde_json::Value;

/// The stored form of `value`, once it is known to read back as `T` and to
/// serialize the same way again.
///
/// # Errors
/// serde's error when `value` holds a non-finite float, does not serialize
/// (a map with non-string keys), does not deserialize from its own JSON, or
/// serializes differently once read back.
pub(crate) fn round_trip<T: Serialize + DeserializeOwned>(
    value: &T,
) -> Result<Value, serde_json::Error> {
    value.serialize(Finite)?;
    let json = serde_json::to_value(value)?;
    let back: T = serde_json::from_value(json.clone())?;
    if serde_json::to_value(&back)? != json {
        return Err(ser::Error::custom(
            "it reads back as a different value (compare its Serialize and Deserialize)",
        ));
    }
    Ok(json)
}

/// A serializer that produces nothing and refuses non-finite floats.
struct Finite;

fn finite(v: f64) -> Result<(), serde_json::Error> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(ser::Error::custom(format_args!(
            "the float {v} has no JSON form (serde_json would store null)"
        )))
    }
}

/// Scalars and unit shapes without a float in them: nothing to check.
macro_rules! accept {
    ($($method:ident($($arg:ty),*);)*) => {$(
        fn $method(self, $(_: $arg),*) -> Result<(), Self::Error> {
            Ok(())
        }
    )*};
}

/// The compound shapes: check each element (after the `&'static str` field
/// name, for structs), then end with nothing.
macro_rules! check_each {
    ($($compound:ident::$method:ident($($name:ty)?);)*) => {$(
        impl ser::$compound for Finite {
            type Ok = ();
            type Error = serde_json::Error;
            fn $method<T: ?Sized + Serialize>(
                &mut self,
                $(_: $name,)?
                value: &T,
            ) -> Result<(), Self::Error> {
                value.serialize(Finite)
            }
            fn end(self) -> Result<(), Self::Error> {
                Ok(())
            }
        }
    )*};
}

impl ser::Serializer for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    fn serialize_f32(self, v: f32) -> Result<(), Self::Error> {
        finite(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Self::Error> {
        finite(v)
    }
    accept! {
        serialize_bool(bool);
        serialize_i8(i8);
        serialize_i16(i16);
        serialize_i32(i32);
        serialize_i64(i64);
        serialize_i128(i128);
        serialize_u8(u8);
        serialize_u16(u16);
        serialize_u32(u32);
        serialize_u64(u64);
        serialize_u128(u128);
        serialize_char(char);
        serialize_str(&str);
        serialize_bytes(&[u8]);
        serialize_none();
        serialize_unit();
        serialize_unit_struct(&'static str);
        serialize_unit_variant(&'static str, u32, &'static str);
    }
    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result<(), Self::Error> {
        value.serialize(self)
    }
    fn serialize_newtype_struct<T: ?Sized + Serialize>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Self::Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        value: &T,
    ) -> Result<(), Self::Error> {
        value.serialize(self)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self, Self::Error> {
        Ok(self)
    }
    fn serialize_tuple(self, _: usize) -> Result<Self, Self::Error> {
        Ok(self)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self, Self::Error> {
        Ok(self)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self, Self::Error> {
        Ok(self)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self, Self::Error> {
        Ok(self)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, Self::Error> {
        Ok(self)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self, Self::Error> {
        Ok(self)
    }
}

check_each! {
    SerializeSeq::serialize_element();
    SerializeTuple::serialize_element();
    SerializeTupleStruct::serialize_field();
    SerializeTupleVariant::serialize_field();
    SerializeStruct::serialize_field(&'static str);
    SerializeStructVariant::serialize_field(&'static str);
}

/// A map: its keys are checked as well as its values.
impl ser::SerializeMap for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result<(), Self::Error> {
        key.serialize(Finite)
    }
    fn serialize_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), Self::Error> {
        value.serialize(Finite)
    }
    fn end(self) -> Result<(), Self::Error> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Serialize, Deserialize)]
    struct Quote {
        price: f64,
        tags: Vec<Option<f32>>,
    }

    #[test]
    fn finite_results_give_their_json() {
        let quote = Quote {
            price: 9.5,
            tags: vec![Some(1.0), None],
        };
        let json = round_trip(&quote).unwrap();
        assert_eq!(json, serde_json::json!({"price": 9.5, "tags": [1.0, null]}));
        assert_eq!(round_trip(&7_i64).unwrap(), 7);
    }

    #[test]
    fn non_finite_floats_are_refused_wherever_they_are() {
        for error in [
            round_trip(&f64::NAN).unwrap_err(),
            round_trip(&Some(f64::INFINITY)).unwrap_err(),
            round_trip(&Quote {
                price: 1.0,
                tags: vec![None, Some(f32::NEG_INFINITY)],
            })
            .unwrap_err(),
            round_trip(&BTreeMap::from([("k".to_owned(), vec![f64::NAN])])).unwrap_err(),
        ] {
            assert!(error.to_string().contains("no JSON form"), "{error}");
        }
    }

    #[test]
    fn every_serde_shape_is_searched_for_non_finite_floats() {
        #[derive(Serialize, Deserialize)]
        struct Pair(u8, f64);
        #[derive(Serialize, Deserialize)]
        struct Wrapped(f32);
        #[derive(Serialize, Deserialize)]
        enum Shape {
            Unit,
            Newtype(f64),
            Tuple(bool, f64),
            Struct { name: String, value: f64 },
        }
        let nan = f64::NAN;
        for error in [
            round_trip(&(1_u8, 'c', nan)).unwrap_err(),
            round_trip(&Pair(1, nan)).unwrap_err(),
            round_trip(&Wrapped(f32::INFINITY)).unwrap_err(),
            round_trip(&Shape::Newtype(nan)).unwrap_err(),
            round_trip(&Shape::Tuple(true, nan)).unwrap_err(),
            round_trip(&Shape::Struct {
                name: "n".into(),
                value: nan,
            })
            .unwrap_err(),
        ] {
            assert!(error.to_string().contains("no JSON form"), "{error}");
        }
        // The same shapes with finite floats (and every scalar) pass.
        assert!(round_trip(&(1_u8, 'c', 2.5, "s".to_owned(), -3_i128, 3_u128, ())).is_ok());
        assert!(round_trip(&Pair(1, 0.5)).is_ok());
        assert!(round_trip(&vec![Shape::Unit, Shape::Newtype(1.0)]).is_ok());
        assert!(round_trip(&Shape::Tuple(false, 1.0)).is_ok());
    }

    #[test]
    fn results_that_serialize_differently_once_read_back_are_refused() {
        // An i64 in a u8's clothing does not deserialize back.
        #[derive(Serialize, Deserialize)]
        struct Small(#[serde(deserialize_with = "small")] u32);
        fn small<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
            u8::deserialize(d).map(u32::from)
        }
        assert!(round_trip(&Small(300)).is_err());
        // Read back, but as something else.
        #[derive(Serialize, Deserialize)]
        struct Lossy(#[serde(deserialize_with = "zero")] u32);
        fn zero<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
            u32::deserialize(d).map(|_| 0)
        }
        let error = round_trip(&Lossy(5)).err().unwrap();
        assert!(error.to_string().contains("different value"), "{error}");
        // A map whose keys are not strings has no JSON form at all.
        assert!(round_trip(&HashMap::from([((1, 2), 3)])).is_err());
    }
}
